//! Emulated devices that decide when a request completes (`[storage.emulated]`), and how a
//! request books the devices its extents are on.

use std::sync::Arc;

use headroom_nbd as nbd;
use headroom_qos::OpKind;
use headroom_store::Volume;

use crate::emulated::EmulatedDevice;
use crate::scheduler::IoDesc;

/// Which emulated devices decide when requests complete (`[storage.emulated]`).
#[derive(Debug, Default)]
pub enum Emulation {
    /// None: a request completes when its operation is done.
    #[default]
    Off,
    /// One device in front of the whole pool.
    Node(Arc<EmulatedDevice>),
    /// One per pool device, by device id (`per_device`): a request books the devices its
    /// extents are on and completes when the last of them is done.
    PerDevice(Vec<Arc<EmulatedDevice>>),
}

impl Emulation {
    /// Channels of all the emulated devices together (`None`: no emulation).
    pub fn parallelism(&self) -> Option<u32> {
        match self {
            Emulation::Off => None,
            Emulation::Node(device) => Some(device.spec().parallelism),
            Emulation::PerDevice(devices) => Some(
                devices
                    .iter()
                    .map(|d| d.spec().parallelism)
                    .fold(0u32, u32::saturating_add),
            ),
        }
    }
}

/// Books a request on the per-device emulated devices of the extents it touches (after it
/// ran, so a write's new extents are placed): each piece on its extent's device, at its
/// length; a read on the device of the copy it was routed to (`read_copy`, copy 0 when not
/// routed), anything else on every copy's device; FLUSH on every device. Returns the device
/// to complete on and when, or `None` when no device works for it (a read of holes, a trim
/// of what is gone).
pub(super) fn book_per_device<'d>(
    devices: &'d [Arc<EmulatedDevice>],
    volume: &Volume,
    request: &nbd::ValidRequest,
    desc: IoDesc,
    sequential: bool,
    read_copy: Option<u8>,
    now_ns: u64,
) -> Option<(&'d Arc<EmulatedDevice>, u64)> {
    let mut latest: Option<(&Arc<EmulatedDevice>, u64)> = None;
    let mut book = |device: &'d Arc<EmulatedDevice>, position: u64, len_bytes: u32| {
        let done_ns = device.book(now_ns, desc.op, position, len_bytes, sequential);
        if latest.is_none_or(|(_, at)| done_ns > at) {
            latest = Some((device, done_ns));
        }
    };
    if matches!(request.command, nbd::Command::Flush) {
        for device in devices {
            book(device, 0, 0);
        }
        return latest;
    }
    let extent_bytes = headroom_store::EXTENT_SIZE_BYTES;
    let start = request.offset;
    let end = start.saturating_add(u64::from(request.length));
    let mut at = start;
    while at < end {
        let extent = at / extent_bytes;
        let piece_end = ((extent + 1) * extent_bytes).min(end);
        let piece = u32::try_from(piece_end - at).unwrap_or(u32::MAX);
        let copies = match desc.op {
            OpKind::Read => {
                let c = read_copy.unwrap_or(0);
                c..c + 1
            }
            _ => 0..volume.replicas().max(1),
        };
        for copy in copies {
            if let Some(location) = volume.replica_location(copy, extent)
                && let Some(device) = usize::try_from(location.device)
                    .ok()
                    .and_then(|d| devices.get(d))
            {
                book(
                    device,
                    location.offset_bytes + at % extent_bytes,
                    if desc.len_bytes == 0 { 0 } else { piece },
                );
            }
        }
        at = piece_end;
    }
    latest
}
