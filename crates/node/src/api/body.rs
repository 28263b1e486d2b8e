//! Oversized request bodies are read to the end before the 413 answer.
//!
//! Why: axum's JSON extractor stops at its 2 MiB limit and answers 413 with the rest of the
//! body unread. The server then closes a connection with unread bytes in its receive buffer,
//! which Linux turns into a reset: a client still sending gets EPIPE instead of the answer,
//! and one that reuses the connection finds it dead (the api_errors test saw both). A request
//! that says its length up front (`Content-Length`) and is over the limit is refused here
//! instead, after its body has been read and dropped (a frame at a time, nothing kept), so
//! the client reads a clean JSON 413 and the connection stays usable. Bodies over
//! [`MAX_DRAIN_BYTES`] are not read: the answer says `Connection: close` and the client may
//! see the reset, a fair price for sending that much to a JSON API.

use std::pin::Pin;

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;

/// Largest body a route takes (axum's default limit, which the JSON extractor applies).
pub const MAX_BODY_BYTES: u64 = 2 << 20;
/// Most bytes of an oversized body read (and dropped) before answering 413.
pub const MAX_DRAIN_BYTES: u64 = 64 << 20;

/// The middleware: refuses a declared length over [`MAX_BODY_BYTES`] after draining it.
pub async fn refuse_oversized(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(length) = declared.filter(|&n| n > MAX_BODY_BYTES) else {
        return next.run(request).await;
    };
    let too_large = ApiError::Request(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the body is {length} bytes, over the limit of {MAX_BODY_BYTES} bytes"),
    );
    if length > MAX_DRAIN_BYTES {
        let mut response = too_large.into_response();
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    drain(request.into_body()).await;
    too_large.into_response()
}

/// Reads `body` to its end (or its first error), dropping every frame.
async fn drain(mut body: Body) {
    let mut read_bytes = 0u64;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        match frame {
            Ok(frame) => {
                read_bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
                // The declared length bounds what hyper delivers; this bounds it again.
                if read_bytes > MAX_DRAIN_BYTES {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}
