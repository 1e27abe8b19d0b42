//! The instance's I/O with the machine: the TUN device (`tun`, the kernel's in `kernel_tun`),
//! packet batches, UDP sockets, interface settings, and the platform that hands them out
//! (`platform`; the in-memory network `memnet` stands in for the machine in tests).

pub(crate) mod batch;
pub(crate) mod interface;
pub(crate) mod kernel_tun;
/// In tests, the machine: the in-process tests (tests/inprocess.rs) run whole instances on it.
#[doc(hidden)]
pub mod memnet;
pub mod platform;
pub(crate) mod socket;
pub(crate) mod tun;
