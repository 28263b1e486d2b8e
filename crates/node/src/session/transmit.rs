//! Transmission: the NBD reader, which decodes and validates each request (and reads a
//! WRITE's payload) and hands it to the pipeline through the connection's `Intake`; the reply
//! writer (`reply`) encodes what the pipeline answers.

use std::sync::Arc;
use std::time::Duration;

use headroom_nbd as nbd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, BufReader};

use super::negotiate::discard;
use super::reply::{is_stalled, read_exact_progressing, write_replies};
use super::{ALLOCATION_CONTEXT_ID, Negotiated, SessionContext, SessionError};
use crate::admission::Admitted;
use crate::pipeline::{Intake, Submission};

/// What the reader does after one request.
enum Next {
    Continue,
    /// The session ends without an error (EOF, NBD_CMD_DISC, a fatal refusal answered).
    End,
}

/// Runs transmission on a connection's two halves: plain TCP halves (no lock between them) or
/// the halves of a TLS stream. Generic, so the plaintext path pays nothing for TLS.
pub(super) async fn transmit<R, W>(
    read_half: R,
    write_half: W,
    ctx: Arc<SessionContext>,
    negotiated: Negotiated,
    conn: &Admitted,
) -> Result<(), SessionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut reader = BufReader::with_capacity(128 << 10, read_half);
    let stall_ms = ctx.pipeline.limits.client_stall_timeout_ms;
    let stall = Duration::from_millis(stall_ms);
    let (mut intake, replies) = Intake::open(
        &ctx.pipeline,
        Arc::clone(&negotiated.volume),
        Some(conn.shared()),
    );
    let writer = tokio::spawn(write_replies(
        write_half,
        replies,
        negotiated.structured,
        Arc::clone(&ctx.pipeline.io.buffers),
        stall,
    ));
    let limits = nbd::ExportLimits {
        size_bytes: negotiated.volume.size_bytes(),
        read_only: negotiated.volume.read_only(),
        max_payload_bytes: ctx.pipeline.limits.max_request_bytes,
        structured_replies: negotiated.structured,
        allocation_context_id: negotiated
            .allocation_context
            .then_some(ALLOCATION_CONTEXT_ID),
    };
    // Ends with the writer: when it gives up on a client that stopped reading, the reader
    // must not go on reading (and running) what the client keeps sending.
    let writer_gone = intake.watch_closed();
    let requests = async {
        loop {
            match next_request(&mut reader, &mut intake, &limits, stall).await {
                Ok(Next::Continue) => {}
                Ok(Next::End) => break Ok(()),
                Err(err) => break Err(err),
            }
        }
    };
    let result = tokio::select! {
        result = requests => result,
        () = writer_gone.closed() => Ok(()),
    };
    drop(writer_gone);
    // Replies for everything already accepted are still delivered (NBD_CMD_DISC semantics).
    let account = intake.close();
    let written = match writer.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) if is_stalled(&err) => Err(SessionError::RepliesStalled(stall_ms)),
        Ok(Err(err)) => {
            tracing::debug!("reply writer ended: {err}");
            Ok(())
        }
        Err(err) => {
            tracing::warn!("reply writer failed: {err}");
            Ok(())
        }
    };
    drop(account);
    result.and(written)
}

/// Reads, validates and hands on one request.
async fn next_request<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
    intake: &mut Intake,
    limits: &nbd::ExportLimits,
    stall: Duration,
) -> Result<Next, SessionError> {
    let mut header_buf = [0u8; nbd::REQUEST_HEADER_LEN];
    // What the reader has read together goes to the scheduler together (`Intake::hold`):
    // before anything here may wait, what is held is submitted.
    if reader.buffer().len() < nbd::REQUEST_HEADER_LEN {
        intake.flush();
    }
    match reader.read_exact(&mut header_buf).await {
        Ok(_) => {}
        // A client that hangs up without NBD_CMD_DISC: nothing to answer.
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Next::End),
        Err(err) => return Err(err.into()),
    }
    if intake.is_closed() {
        return Ok(Next::End);
    }
    crate::coalesce::note_request();
    let header = nbd::decode_request_header(&header_buf)?;
    let arrival_ns = intake.now_ns();
    let Some(slot) = intake.request_slot_flushing().await else {
        return Ok(Next::End);
    };
    let request = match nbd::validate_request(&header, limits) {
        Ok(request) => request,
        Err(rejection) => {
            let fatal = rejection.is_fatal();
            let payload = rejection.payload_bytes();
            if payload > 0 && !fatal {
                intake.flush();
                discard(reader, u64::from(payload)).await?;
            }
            let answer = (rejection.errno(), rejection.message());
            intake.refuse(header.cookie, header.command, answer, slot, arrival_ns);
            return Ok(if fatal { Next::End } else { Next::Continue });
        }
    };
    tracing::trace!(
        command = request.command.name(),
        offset = request.offset,
        length = request.length,
        "request"
    );
    if matches!(request.command, nbd::Command::Disc) {
        return Ok(Next::End);
    }
    let Some(permits) = intake.charge_flushing(&request, slot).await? else {
        return Ok(Next::End);
    };
    let mut write_payload = None;
    if matches!(request.command, nbd::Command::Write) {
        if reader.buffer().len() < request.length as usize {
            intake.flush();
        }
        let payload = write_payload.insert(intake.payload_buffer(request.length));
        // A payload cut short (or stalled): the write never happened and nobody is left to
        // answer.
        match read_exact_progressing(reader, payload.as_mut_slice(), stall).await {
            Ok(()) => {}
            Err(err) if is_stalled(&err) => {
                return Err(SessionError::PayloadStalled(
                    u64::try_from(stall.as_millis()).unwrap_or(u64::MAX),
                ));
            }
            Err(err) => return Err(err.into()),
        }
    }
    // With structured replies, a READ of a hole is answered by a hole chunk instead of zeros
    // (as qemu-nbd does), unless the client asked for one data chunk (DF).
    let sparse_read = limits.structured_replies && !request.df;
    intake.hold(Submission {
        request,
        permits,
        write_payload,
        sparse_read,
        arrival_ns,
    });
    Ok(Next::Continue)
}
