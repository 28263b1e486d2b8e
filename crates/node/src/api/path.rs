//! The path parameters of the API's routes (`{name}`, `{id}`, `{file}`), with the API's JSON
//! error when they do not parse.
//!
//! Why: axum's own `Path` answers a parameter it cannot parse (a device id that is not a
//! `u32`, such as `-1`; a percent-encoding that is not UTF-8, such as `%FF`) with a plain-text
//! 400, the one error of the API that was not `{"error", "kind"}` (schemathesis and the
//! `router` fuzz target both found it). [`ApiPath`] is `Path` with that rejection turned into
//! a 400 `invalid_path` of the usual shape.

use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::ApiError;

/// `axum::extract::Path`, refusing with [`ApiError`].
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::Request(rejection.status(), "invalid_path", rejection.body_text())
    }
}

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(value) = Path::<T>::from_request_parts(parts, state).await?;
        Ok(ApiPath(value))
    }
}
