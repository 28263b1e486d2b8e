//! A volume's vhost-user-blk attachments over the API: list (`GET`), attach (`POST`) and
//! detach (`DELETE /v1/volumes/{name}/attachments`). A module of its own so the volume
//! routes stay about the volume's configuration; the attachments themselves live in
//! `crate::vhost_user::Attachments` (stored with the volume, restored at start).

use std::path::PathBuf;

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiError, ApiErrorBody, ApiPath, ApiResult, ApiState};
use crate::vhost_user::{AttachmentError, AttachmentSpec, AttachmentState};

pub(super) fn routes() -> Router<ApiState> {
    Router::new().route(
        "/v1/volumes/{name}/attachments",
        get(list_attachments)
            .post(attach_volume)
            .delete(detach_volume),
    )
}

/// Body of `DELETE /v1/volumes/{name}/attachments`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Detach {
    /// The vhost-user socket's path.
    #[schema(value_type = String)]
    pub vhost_user: PathBuf,
}

/// Body of `GET /v1/volumes/{name}/attachments`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AttachmentsView {
    pub attachments: Vec<AttachmentView>,
}

/// One attachment: as asked for, and what its frontend is doing now.
#[derive(Debug, Serialize, ToSchema)]
pub struct AttachmentView {
    #[serde(flatten)]
    pub spec: AttachmentSpec,
    pub state: AttachmentState,
}

fn attachment_error(err: AttachmentError) -> ApiError {
    let (status, kind) = match &err {
        AttachmentError::UnknownVolume(_) => (StatusCode::NOT_FOUND, "not_found"),
        AttachmentError::NotAttached(..) => (StatusCode::NOT_FOUND, "not_attached"),
        AttachmentError::NumQueues(_) => (StatusCode::BAD_REQUEST, "invalid_num_queues"),
        AttachmentError::PollUs(_) => (StatusCode::BAD_REQUEST, "invalid_poll_us"),
        AttachmentError::RelativePath(_) => (StatusCode::BAD_REQUEST, "invalid_path"),
        AttachmentError::Taken(..) => (StatusCode::CONFLICT, "already_attached"),
        AttachmentError::Socket(_) => (StatusCode::CONFLICT, "invalid_socket"),
        AttachmentError::Serve(_) | AttachmentError::Store(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "attach_failed")
        }
    };
    ApiError::Request(status, kind, err.to_string())
}

fn view(state: &ApiState, name: &str) -> AttachmentsView {
    AttachmentsView {
        attachments: state
            .attachments
            .list(Some(name))
            .into_iter()
            .map(|(_, spec, state)| AttachmentView { spec, state })
            .collect(),
    }
}

/// The volume's vhost-user-blk attachments being served.
#[utoipa::path(get, path = "/v1/volumes/{name}/attachments", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, body = AttachmentsView),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume", body = ApiErrorBody)))]
pub(super) async fn list_attachments(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<AttachmentsView>> {
    state.store.volume_info(&name)?;
    Ok(Json(view(&state, &name)))
}

/// Serves the volume as a vhost-user-blk device on a Unix socket, listening when this
/// answers, and stores the attachment so a restart serves it again.
#[utoipa::path(post, path = "/v1/volumes/{name}/attachments", tag = "volumes",
    request_body = AttachmentSpec,
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 201, body = AttachmentsView),
        (status = 400, description = "num_queues out of range or a relative socket path (nothing touched), or a path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume", body = ApiErrorBody),
        (status = 409, description = "The path is attached already, is not a socket, is a live socket, or the mode/owner cannot be given", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody)))]
pub(super) async fn attach_volume(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
    body: Result<Json<AttachmentSpec>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<AttachmentsView>)> {
    let Json(spec) = body?;
    state
        .attachments
        .attach(&name, spec)
        .await
        .map_err(attachment_error)?;
    Ok((StatusCode::CREATED, Json(view(&state, &name))))
}

/// Ends an attachment: its frontend is disconnected, the socket removed, the record dropped.
#[utoipa::path(delete, path = "/v1/volumes/{name}/attachments", tag = "volumes",
    request_body = Detach,
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 204, description = "Detached"),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume, or not attached there", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody)))]
pub(super) async fn detach_volume(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
    body: Result<Json<Detach>, JsonRejection>,
) -> ApiResult<StatusCode> {
    let Json(detach) = body?;
    state
        .attachments
        .detach(&name, &detach.vhost_user)
        .await
        .map_err(attachment_error)?;
    Ok(StatusCode::NO_CONTENT)
}
