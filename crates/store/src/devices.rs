//! The pool's devices: a list that grows while the store runs (`Store::add_device`) and that
//! the I/O path reads without a lock.
//!
//! Why not a `Vec` behind a lock: every read and write looks its extent's device up, on many
//! threads at once, and a device is added perhaps once a month. So the list is a fixed array
//! of `MAX_DEVICES` write-once slots and a count. A device is put in its slot before the
//! count is raised past it (release), and readers load the count (acquire) before they look
//! at slots, so no reader ever finds an empty slot below the count. Devices are never
//! removed: ids stay valid for the life of the store.

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::MAX_DEVICES;
use crate::device::Device;

pub(crate) struct Devices {
    slots: Box<[OnceLock<Device>]>,
    count: AtomicUsize,
}

impl fmt::Debug for Devices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Devices")
            .field("count", &self.len())
            .finish_non_exhaustive()
    }
}

impl Devices {
    /// The devices of a store being opened, ids `0..devices.len()` in order. More than
    /// `MAX_DEVICES` is the caller's error (`Store::open` refuses them first); the extra
    /// ones are dropped.
    pub(crate) fn new(devices: Vec<Device>) -> Devices {
        let slots: Box<[OnceLock<Device>]> =
            (0..MAX_DEVICES as usize).map(|_| OnceLock::new()).collect();
        let mut count = 0;
        for (slot, device) in slots.iter().zip(devices) {
            let _ = slot.set(device);
            count += 1;
        }
        Devices {
            slots,
            count: AtomicUsize::new(count),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub(crate) fn get(&self, id: usize) -> Option<&Device> {
        if id < self.len() {
            self.slots.get(id).and_then(OnceLock::get)
        } else {
            None
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Device> {
        (0..self.len()).filter_map(|id| self.get(id))
    }

    /// Appends `device`, whose id must be the current count. Callers serialise additions (the
    /// store's management lock). Gives the device back if the list is full or the id is wrong.
    pub(crate) fn push(&self, device: Device) -> Result<usize, Box<Device>> {
        let id = self.len();
        if device.id as usize != id {
            return Err(Box::new(device));
        }
        let Some(slot) = self.slots.get(id) else {
            return Err(Box::new(device));
        };
        slot.set(device).map_err(Box::new)?;
        self.count.store(id + 1, Ordering::Release);
        Ok(id)
    }
}

impl<'a> IntoIterator for &'a Devices {
    type Item = &'a Device;
    type IntoIter = Box<dyn Iterator<Item = &'a Device> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}
