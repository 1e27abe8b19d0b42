//! Control: the instance's endpoints (`socket.rs`: the root-only unix socket, the metrics
//! listener; `dashboard.rs`: the web dashboard), what they serve (`report.rs`), a live reload
//! of the configuration (`reload.rs`), and the command line's half (`query.rs`).

pub mod dashboard;
pub mod query;
pub mod reload;
pub mod report;
pub mod socket;

pub use query::{default_socket, get_over_socket, reload_over_socket, socket_of_pid};
pub use report::StatusFn;
pub use socket::{router, serve, ControlSocket};
