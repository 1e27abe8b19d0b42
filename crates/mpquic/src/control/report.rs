//! What the control endpoints serve: the instance's status report, made on demand
//! (`StatusFn`), as JSON or as OpenMetrics text.

use std::sync::Arc;

use crate::status::StatusReport;

pub type StatusFn = Arc<dyn Fn() -> StatusReport + Send + Sync>;

/// The OpenMetrics body and its content type.
pub fn metrics_text(
    status: &StatusFn,
) -> ([(axum::http::header::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::status::CONTENT_TYPE,
        )],
        status().to_openmetrics(),
    )
}
