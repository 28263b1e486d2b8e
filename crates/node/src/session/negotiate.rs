//! Negotiation: option haggling until the client enters transmission, starts TLS or leaves.

use std::sync::Arc;

use headroom_nbd as nbd;
use headroom_nbd::consts;
use headroom_store::Volume;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{
    ALLOCATION_CONTEXT_ID, ALLOCATION_CONTEXT_NAME, Negotiated, SessionContext, SessionError, Tls,
};
use crate::admission::Admitted;

/// How option haggling ended.
pub(super) enum Outcome {
    /// The client ended it cleanly (ABORT or EOF).
    End,
    Transmit(Negotiated),
    /// We acknowledged `NBD_OPT_STARTTLS`: the TLS handshake comes next.
    StartTls(Arc<Tls>),
}

/// Runs option haggling on `stream` until the client enters transmission, starts TLS, or
/// leaves.
pub(super) async fn negotiate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ctx: &SessionContext,
    state: &mut Haggling,
    conn: &Admitted,
) -> Result<Outcome, SessionError> {
    let mut out = Vec::with_capacity(256);
    loop {
        let mut header_buf = [0u8; 16];
        match stream.read_exact(&mut header_buf).await {
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Outcome::End),
            Err(err) => return Err(err.into()),
        }
        let header = nbd::decode_option_header(&header_buf)?;
        out.clear();
        match nbd::option_data_action(&header) {
            nbd::OptionDataAction::Read => {}
            nbd::OptionDataAction::DiscardThenReply { reply_type } => {
                discard(stream, u64::from(header.length)).await?;
                nbd::encode_option_error(&mut out, header.option, reply_type, "option too large");
                stream.write_all(&out).await?;
                continue;
            }
            nbd::OptionDataAction::Close => {
                // Reading gigabytes to stay in sync would be a denial of service: say why (when
                // the option has an error reply at all), then close.
                if header.option != consts::NBD_OPT_EXPORT_NAME {
                    nbd::encode_option_error(
                        &mut out,
                        header.option,
                        consts::NBD_REP_ERR_TOO_BIG,
                        "option too large",
                    );
                    // Best effort: the client may already be gone.
                    let _ = stream.write_all(&out).await;
                }
                return Err(SessionError::OptionTooLarge(header.length));
            }
        }
        let mut data = vec![0u8; header.length as usize];
        stream.read_exact(&mut data).await?;
        let step = match nbd::decode_option(&header, &data) {
            Ok(option) => state.answer(ctx, header.option, option, &mut out)?,
            // A malformed EXPORT_NAME has no error reply: the spec's only answer is to close.
            Err(err) if err.closes_connection() => Step::End,
            Err(err) => {
                nbd::encode_option_error(
                    &mut out,
                    header.option,
                    err.reply_type(),
                    &err.to_string(),
                );
                Step::Continue
            }
        };
        match step {
            Step::Continue => stream.write_all(&out).await?,
            Step::Transmit(negotiated) => {
                // Transmitting (never evicted) from before the client can see the reply.
                let volume = &negotiated.volume;
                if !conn.enter_transmission(volume.name(), volume.tenant()) {
                    return Err(SessionError::Evicted);
                }
                stream.write_all(&out).await?;
                return Ok(Outcome::Transmit(negotiated));
            }
            Step::StartTls(tls) => {
                // The ACK is the last plaintext byte; the client starts the handshake.
                stream.write_all(&out).await?;
                stream.flush().await?;
                return Ok(Outcome::StartTls(tls));
            }
            Step::End => {
                // The client may close without reading a final ack; that is fine.
                let _ = stream.write_all(&out).await;
                return Ok(Outcome::End);
            }
        }
    }
}

/// What negotiation has settled so far.
pub(super) struct Haggling {
    pub(super) client_flags: nbd::ClientFlags,
    no_zeroes: bool,
    structured: bool,
    /// (export name, base:allocation selected) from the last SET_META_CONTEXT.
    meta_selection: Option<(String, bool)>,
    /// The session runs over TLS.
    pub(super) tls_active: bool,
    /// Whose volumes this session may see: the TLS client's identity, `None` before TLS and
    /// for an anonymous TLS client (see `visible_export`).
    pub(super) tenant: Option<String>,
}

/// What follows an option's reply.
enum Step {
    Continue,
    Transmit(Negotiated),
    StartTls(Arc<Tls>),
    End,
}

impl Haggling {
    pub(super) fn new(client_flags: nbd::ClientFlags) -> Haggling {
        Haggling {
            client_flags,
            no_zeroes: client_flags.no_zeroes,
            structured: false,
            meta_selection: None,
            tls_active: false,
            tenant: None,
        }
    }

    /// The volume `name` if this session may see it, else `None`, the answer for a name no
    /// volume has: the callers answer both the same way, so a client cannot tell another
    /// tenant's volume from a missing one. A session with a tenant sees that tenant's volumes
    /// only; a session without one (plaintext, or TLS without a client identity) sees only
    /// volumes without a tenant.
    fn visible_export(&self, ctx: &SessionContext, name: &str) -> Option<Arc<Volume>> {
        let volume = ctx.store.open_volume(name).ok()?;
        if volume.tenant() == self.tenant.as_deref() {
            return Some(volume);
        }
        tracing::debug!(
            "session of tenant {:?} asked for {name:?}, a volume of tenant {:?}: answered as unknown",
            self.tenant,
            volume.tenant()
        );
        None
    }

    /// FORCEDTLS before the upgrade: "If the server receives any other option, it MUST reply
    /// with NBD_REP_ERR_TLS_REQD if TLS has not been initiated"; EXPORT_NAME cannot be
    /// refused, so "it MUST terminate the session". `None`: the option goes on to `answer`.
    fn refuse_without_tls(
        &self,
        ctx: &SessionContext,
        option_number: u32,
        option: &nbd::ClientOption,
        out: &mut Vec<u8>,
    ) -> Option<Result<Step, SessionError>> {
        if self.tls_active || !ctx.tls_required {
            return None;
        }
        match option {
            nbd::ClientOption::StartTls | nbd::ClientOption::Abort => None,
            nbd::ClientOption::ExportName(name) => {
                Some(Err(SessionError::TlsRequired(name.clone())))
            }
            _ => {
                let message = "this server requires TLS: send NBD_OPT_STARTTLS first";
                nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_TLS_REQD, message);
                Some(Ok(Step::Continue))
            }
        }
    }

    /// Appends the reply to one decoded option to `out` and says what comes next.
    fn answer(
        &mut self,
        ctx: &SessionContext,
        option_number: u32,
        option: nbd::ClientOption,
        out: &mut Vec<u8>,
    ) -> Result<Step, SessionError> {
        if let Some(step) = self.refuse_without_tls(ctx, option_number, &option, out) {
            return step;
        }
        match option {
            nbd::ClientOption::ExportName(name) => self.export_name(ctx, name, out),
            nbd::ClientOption::Info(request) | nbd::ClientOption::Go(request) => {
                Ok(self.info_or_go(ctx, option_number, request, out))
            }
            nbd::ClientOption::List => {
                // Only the volumes this session could open (`visible_export`).
                let visible = ctx
                    .store
                    .list_volumes()
                    .into_iter()
                    .filter(|info| info.tenant == self.tenant);
                for info in visible {
                    let description = format!("{} bytes", info.size_bytes);
                    nbd::encode_rep_server(out, option_number, &info.name, &description);
                }
                ack(out, option_number);
                Ok(Step::Continue)
            }
            nbd::ClientOption::Abort => {
                ack(out, option_number);
                Ok(Step::End)
            }
            nbd::ClientOption::StructuredReply => {
                if self.structured {
                    nbd::encode_option_error(
                        out,
                        option_number,
                        consts::NBD_REP_ERR_INVALID,
                        "structured replies already negotiated",
                    );
                } else {
                    self.structured = true;
                    ack(out, option_number);
                }
                Ok(Step::Continue)
            }
            nbd::ClientOption::ListMetaContext(request)
            | nbd::ClientOption::SetMetaContext(request) => {
                Ok(self.meta_context(ctx, option_number, request, out))
            }
            nbd::ClientOption::StartTls => Ok(self.start_tls(ctx, option_number, out)),
            nbd::ClientOption::ExtendedHeaders => {
                let message = "not supported by this server";
                nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_UNSUP, message);
                Ok(Step::Continue)
            }
            nbd::ClientOption::Unknown(_) => {
                let message = "unknown option";
                nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_UNSUP, message);
                Ok(Step::Continue)
            }
        }
    }

    /// `NBD_OPT_EXPORT_NAME`: the spec leaves no way to refuse it but closing.
    fn export_name(
        &self,
        ctx: &SessionContext,
        name: String,
        out: &mut Vec<u8>,
    ) -> Result<Step, SessionError> {
        let Some(volume) = self.visible_export(ctx, &name) else {
            return Err(SessionError::UnknownExport(name));
        };
        let flags = transmission_flags(&volume, self.structured);
        nbd::encode_export_name_reply(out, volume.size_bytes(), flags, self.no_zeroes);
        let allocation_context = self.structured && self.selected_for(&name);
        Ok(Step::Transmit(Negotiated {
            volume,
            structured: self.structured,
            allocation_context,
        }))
    }

    /// `NBD_OPT_INFO` and `NBD_OPT_GO`: the export's information; GO then transmits.
    fn info_or_go(
        &self,
        ctx: &SessionContext,
        option_number: u32,
        request: nbd::InfoRequest,
        out: &mut Vec<u8>,
    ) -> Step {
        let Some(volume) = self.visible_export(ctx, &request.export_name) else {
            return unknown(out, option_number, &request.export_name);
        };
        let flags = transmission_flags(&volume, self.structured);
        nbd::encode_info_export(out, option_number, volume.size_bytes(), flags);
        for info in &request.info_types {
            match *info {
                consts::NBD_INFO_NAME => {
                    nbd::encode_info_name(out, option_number, volume.name());
                }
                consts::NBD_INFO_DESCRIPTION => {
                    nbd::encode_info_description(out, option_number, &describe(&volume));
                }
                _ => {}
            }
        }
        // Always sent: clients that did not ask still benefit from knowing our limit.
        nbd::encode_info_block_size(
            out,
            option_number,
            nbd::MIN_BLOCK_BYTES,
            nbd::PREFERRED_BLOCK_BYTES,
            ctx.pipeline.limits.max_request_bytes,
        );
        ack(out, option_number);
        if option_number != consts::NBD_OPT_GO {
            return Step::Continue;
        }
        let allocation_context = self.structured && self.selected_for(&request.export_name);
        Step::Transmit(Negotiated {
            volume,
            structured: self.structured,
            allocation_context,
        })
    }

    /// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT` (`base:allocation` only).
    fn meta_context(
        &mut self,
        ctx: &SessionContext,
        option_number: u32,
        request: nbd::MetaContextRequest,
        out: &mut Vec<u8>,
    ) -> Step {
        let is_set = option_number == consts::NBD_OPT_SET_META_CONTEXT;
        if !self.structured {
            nbd::encode_option_error(
                out,
                option_number,
                consts::NBD_REP_ERR_INVALID,
                "negotiate structured replies first",
            );
            return Step::Continue;
        }
        if self.visible_export(ctx, &request.export_name).is_none() {
            return unknown(out, option_number, &request.export_name);
        }
        let matches = nbd::allocation_context_matches(&request.queries, is_set);
        if matches {
            nbd::encode_rep_meta_context(
                out,
                option_number,
                ALLOCATION_CONTEXT_ID,
                ALLOCATION_CONTEXT_NAME,
            );
        }
        ack(out, option_number);
        if is_set {
            self.meta_selection = Some((request.export_name, matches));
        }
        Step::Continue
    }

    /// The answer to `NBD_OPT_STARTTLS` (spec, "TLS support").
    fn start_tls(&self, ctx: &SessionContext, option_number: u32, out: &mut Vec<u8>) -> Step {
        let refuse = |out: &mut Vec<u8>, reply_type: u32, message: &str| {
            nbd::encode_option_error(out, option_number, reply_type, message);
            Step::Continue
        };
        let Some(tls) = &ctx.tls else {
            // NOTLS: "MUST respond with NBD_REP_ERR_POLICY ... [or] NBD_REP_ERR_UNSUP (if it
            // does not support the NBD_OPT_STARTTLS option at all)".
            return refuse(
                out,
                consts::NBD_REP_ERR_UNSUP,
                "TLS is not configured on this server",
            );
        };
        if self.tls_active {
            // "If the server receives NBD_OPT_STARTTLS when TLS has already been negotiated, it
            // MUST reply with NBD_REP_ERR_INVALID."
            return refuse(out, consts::NBD_REP_ERR_INVALID, "TLS is already running");
        }
        if !self.client_flags.fixed_newstyle {
            // "The server MUST operate in NOTLS mode unless ... the client replied with
            // NBD_FLAG_C_FIXED_NEWSTYLE".
            return refuse(
                out,
                consts::NBD_REP_ERR_POLICY,
                "TLS needs fixed newstyle negotiation",
            );
        }
        nbd::encode_option_reply(out, option_number, consts::NBD_REP_ACK, &[]);
        Step::StartTls(Arc::clone(tls))
    }

    fn selected_for(&self, export: &str) -> bool {
        matches!(&self.meta_selection, Some((name, true)) if name == export)
    }
}

fn describe(volume: &Volume) -> String {
    format!("headroom volume {}", volume.name())
}

/// Flags we advertise for `volume` (`NBD_FLAG_READ_ONLY` for a read-only volume).
fn transmission_flags(volume: &Volume, structured: bool) -> u16 {
    nbd::transmission_flags(volume.read_only(), structured)
}

pub(super) async fn discard<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut R,
    bytes: u64,
) -> std::io::Result<()> {
    let copied = tokio::io::copy(&mut reader.take(bytes), &mut tokio::io::sink()).await?;
    if copied < bytes {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}
/// `NBD_REP_ACK` to option `option_number`.
fn ack(out: &mut Vec<u8>, option_number: u32) {
    nbd::encode_option_reply(out, option_number, consts::NBD_REP_ACK, &[]);
}

/// The answer for a name this session cannot see (missing, or another tenant's: alike).
fn unknown(out: &mut Vec<u8>, option_number: u32, name: &str) -> Step {
    let message = format!("no export named {name:?}");
    nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_UNKNOWN, &message);
    Step::Continue
}
