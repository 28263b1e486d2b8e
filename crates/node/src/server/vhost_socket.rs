//! The node's [`SocketBinder`] for vhost-user attachments: the same socket-file rules as the
//! NBD Unix socket's (`server::unix_socket`: the owner checked first, a path that is not a
//! socket refused and never unlinked, a live socket refused, a stale one replaced, the mode
//! and owner set before `listen`, the file removed when the attachment ends if it is still
//! the one bound), so an operator's typo in `--vhost-user` deletes nothing either.

use crate::config::UnixSocketConfig;
use crate::vhost_user::{AttachmentSpec, BindError, BoundSocket, SocketBinder};
use std::future::Future;
use std::pin::Pin;

use super::unix_socket;

#[derive(Debug)]
pub(super) struct VhostSocketBinder;

fn socket_config(spec: &AttachmentSpec) -> UnixSocketConfig {
    UnixSocketConfig {
        path: spec.vhost_user.clone(),
        mode: spec.mode,
        uid: spec.uid,
        gid: spec.gid,
        tenants: Default::default(),
    }
}

impl SocketBinder for VhostSocketBinder {
    fn check<'a>(
        &'a self,
        spec: &'a AttachmentSpec,
    ) -> Pin<Box<dyn Future<Output = Result<(), BindError>> + Send + 'a>> {
        Box::pin(async move {
            let config = socket_config(spec);
            config
                .validate()
                .map_err(|err| -> BindError { err.to_string().into() })?;
            unix_socket::check(&config).await?;
            Ok(())
        })
    }

    fn bind<'a>(
        &'a self,
        spec: &'a AttachmentSpec,
    ) -> Pin<Box<dyn Future<Output = Result<BoundSocket, BindError>> + Send + 'a>> {
        Box::pin(async move {
            let (listener, file) = unix_socket::bind(&socket_config(spec)).await?;
            let listener = listener.into_std()?;
            Ok(BoundSocket {
                listener,
                guard: Box::new(file),
            })
        })
    }
}
