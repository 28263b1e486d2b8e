//! How the node carries out mirror rebuilds: starting one when an action replaces a volume,
//! sending its copy reads and writes (and, under `raid1`, the tenant's I/O) through the
//! policies, completing them, and releasing and billing the old volume.
//!
//! These are `Node` methods because a copy request is an ordinary request to the node: it
//! takes a slot, a worker and a place in a policy's queue, and is paced and charged like a
//! tenant's. They live here, beside the bookkeeping of [`super::Rebuild`], so that everything
//! a rebuild does is in one place; the node's event loop calls in at the points marked
//! `pub(in crate::node)`.

use super::{Rebuild, Role};
use crate::node::{Ev, Io, NONE, NS_PER_S_F, Node, SlotState, secs_to_ns};
use crate::scenario::{DispatchMode, RebuildSpec, RebuildTenantIo};
use headroom_qos::{Observed, OpKind, VolumeId, VolumeQos};

impl Node<'_> {
    /// A tenant request while rebuilds are on: under `raid1`, reads of data the new volume
    /// does not have yet go to the old volume, and writes go to both.
    #[cold]
    #[inline(never)]
    pub(in crate::node) fn submit_tenant_during_rebuilds(
        &mut self,
        ti: usize,
        worker: usize,
        volume: VolumeId,
        io: Io,
        now_ns: u64,
    ) {
        let r = self.rb.of_tenant[ti];
        let raid1 = r != NONE && {
            let rb = &self.rb.list[r as usize];
            rb.tenant_io == RebuildTenantIo::Raid1 && !rb.copied()
        };
        if !raid1 {
            let slot = self.submit(ti, worker, volume, io, now_ns);
            self.set_role(slot, Role::Tenant);
            return;
        }
        let r = r as usize;
        let group = self.tenants[ti].group as usize;
        let old = self.rb.list[r].old;
        match io.op {
            OpKind::Read => {
                let end = io.offset_bytes + u64::from(io.len_bytes);
                let from_old = end > self.rb.list[r].in_sync_below_bytes();
                let target = if from_old { old } else { volume };
                let slot = self.submit(ti, worker, target, io, now_ns);
                self.set_role(slot, Role::Tenant);
                if from_old {
                    self.rb.list[r].old_requests += 1;
                    if let Some(st) = self.groups[group].rebuild.as_mut() {
                        st.tenant_reads_from_old += 1;
                    }
                }
            }
            _ => {
                let a = self.submit(ti, worker, volume, io, now_ns);
                let b = self.submit(ti, worker, old, io, now_ns);
                self.set_role(a, Role::Mirror { partner: b });
                self.set_role(b, Role::Mirror { partner: a });
                self.rb.list[r].old_requests += 1;
                if let Some(st) = self.groups[group].rebuild.as_mut() {
                    st.tenant_writes_mirrored += 1;
                }
            }
        }
    }

    fn set_role(&mut self, slot: u32, role: Role) {
        let i = slot as usize;
        if self.rb.roles.len() <= i {
            self.rb.roles.resize(i + 1, Role::Tenant);
        }
        self.rb.roles[i] = role;
    }

    /// Whether tenant `ti` is still rebuilding onto its current volume, in which case a
    /// replacement of it is skipped (and counted).
    pub(in crate::node) fn skip_while_rebuilding(&mut self, ti: usize) -> bool {
        if self.rb.of_tenant.get(ti).is_none_or(|&r| r == NONE) {
            return false;
        }
        let group = self.tenants[ti].group as usize;
        if let Some(st) = self.groups[group].rebuild.as_mut() {
            st.skipped += 1;
        }
        true
    }

    /// Replaces tenant `ti`'s volume by a fresh one with `qos` and starts copying the old one
    /// onto it; the tenant's requests already issued stay on the old volume. A tenant whose
    /// previous rebuild still holds its old volume keeps its volume (counted as skipped).
    pub(in crate::node) fn start_rebuild(
        &mut self,
        now_ns: u64,
        ti: usize,
        qos: &VolumeQos,
        spec: &RebuildSpec,
        overlap_s: f64,
    ) {
        if self.skip_while_rebuilding(ti) {
            return;
        }
        let group = self.tenants[ti].group as usize;
        let old = self.tenants[ti].volume;
        let new = self.next_volume;
        self.next_volume += 1;
        for (w, num, den) in self.shares(ti) {
            let share = qos.scaled(num, den);
            self.workers[w].policy.add_volume(now_ns, new, &share);
        }
        self.tenants[ti].volume = new;
        let old_requests = self
            .slots
            .iter()
            .filter(|s| {
                s.state != SlotState::Free && s.tenant as usize == ti && s.req.volume == old
            })
            .count() as u64;
        let mut rb = Rebuild::new(
            ti as u32,
            old,
            new,
            self.tenants[ti].volume_bytes,
            spec,
            now_ns,
        );
        rb.release_not_before_ns = now_ns + secs_to_ns(overlap_s);
        rb.old_requests = old_requests;
        let r = self.rb.list.len();
        self.rb.list.push(rb);
        self.rb.of_tenant[ti] = r as u32;
        let g = &mut self.groups[group];
        g.volumes_created += 1;
        if let Some(st) = g.rebuild.as_mut() {
            st.started += 1;
        }
        while let Some((offset, len)) = self.rb.list[r].start_chunk() {
            self.submit_copy(r, OpKind::Read, offset, len, now_ns);
        }
    }

    /// Sends one copy request of rebuild `r`: a read from the old volume or a write to the new.
    fn submit_copy(&mut self, r: usize, op: OpKind, offset: u64, len: u32, now_ns: u64) {
        let ti = self.rb.list[r].tenant as usize;
        let worker = match self.dispatch {
            DispatchMode::OneToN => {
                let rb = &mut self.rb.list[r];
                let w = rb.spray as usize % self.workers.len();
                rb.spray = rb.spray.wrapping_add(1);
                w
            }
            DispatchMode::OneToOne | DispatchMode::Stealing => {
                self.home_worker(&self.tenants[ti], 0)
            }
        };
        let rb = &mut self.rb.list[r];
        let (volume, role) = if op == OpKind::Read {
            rb.old_requests += 1;
            (rb.old, Role::CopyRead { rebuild: r as u32 })
        } else {
            (rb.new, Role::CopyWrite { rebuild: r as u32 })
        };
        let io = Io {
            op,
            offset_bytes: offset,
            len_bytes: len,
            sequential: true,
        };
        let slot = self.submit(ti, worker, volume, io, now_ns);
        self.set_role(slot, role);
    }

    /// The part of a completion that rebuilds change, before the usual one: keeps the count
    /// of the old volume's requests, and completes copy requests and first halves of
    /// mirrored writes (which the tenant does not see). Returns `true` when the completion is
    /// fully handled here.
    #[cold]
    #[inline(never)]
    pub(in crate::node) fn on_rebuild_complete(&mut self, slot: u32, now_ns: u64) -> bool {
        let (w, ti, volume, offset, len, device_cost) = {
            let s = &self.slots[slot as usize];
            (
                s.worker as usize,
                s.tenant as usize,
                s.req.volume,
                s.req.offset_bytes,
                s.req.len_bytes,
                s.device_cost_ns,
            )
        };
        let group = self.tenants[ti].group as usize;
        let r = self.rb.of_tenant[ti];
        let role = self
            .rb
            .roles
            .get(slot as usize)
            .copied()
            .unwrap_or(Role::Tenant);
        let on_old = r != NONE && self.rb.list[r as usize].old == volume;
        if on_old {
            self.rb.list[r as usize].old_requests -= 1;
        }
        if role == Role::Tenant {
            if on_old {
                // Looked at once the usual completion (the policy's included) is done.
                self.schedule_release(r as usize, now_ns);
            }
            return false;
        }
        let observed = {
            let s = &self.slots[slot as usize];
            Observed {
                service_ns: s.service_ns,
                queue_ns: s.wait_ns,
            }
        };
        self.retire(w, slot, now_ns, observed);
        let mut st = self.groups[group].rebuild.unwrap_or_default();
        match role {
            Role::Tenant => {}
            Role::Mirror { partner } => {
                // The other half completes the tenant's write.
                self.set_role(partner, Role::Tenant);
                let g = &self.groups[group];
                if now_ns >= g.from_ns && now_ns < g.to_ns {
                    self.tenants[ti].device_ns += device_cost;
                }
            }
            Role::CopyRead { rebuild } => {
                st.copy_reads += 1;
                self.submit_copy(rebuild as usize, OpKind::Write, offset, len, now_ns);
            }
            Role::CopyWrite { rebuild } => {
                let rc = rebuild as usize;
                st.copy_writes += 1;
                st.bytes_copied += u64::from(len);
                let rb = &mut self.rb.list[rc];
                rb.chunk_written(offset, len, now_ns);
                if rb.copied() {
                    let took_ns = now_ns - rb.started_ns;
                    st.copied += 1;
                    st.copy_ns_sum += took_ns;
                    st.copy_ns_max = st.copy_ns_max.max(took_ns);
                }
                while let Some((o, l)) = self.rb.list[rc].start_chunk() {
                    self.submit_copy(rc, OpKind::Read, o, l, now_ns);
                }
            }
        }
        if let Some(g) = self.groups[group].rebuild.as_mut() {
            *g = st;
        }
        if r != NONE {
            self.maybe_release(r as usize, now_ns);
        }
        self.kick(w, now_ns);
        true
    }

    #[cold]
    #[inline(never)]
    pub(in crate::node) fn on_release(&mut self, r: usize, now_ns: u64) {
        self.rb.list[r].release_scheduled = false;
        self.maybe_release(r, now_ns);
    }

    /// Asks for a release check of rebuild `r` at `now_ns` (or when its `overlap_s` ends), if
    /// one could succeed: the copy is done and no request uses the old volume.
    fn schedule_release(&mut self, r: usize, now_ns: u64) {
        let rb = &mut self.rb.list[r];
        if rb.released || rb.release_scheduled || !rb.copied() || rb.old_requests > 0 {
            return;
        }
        rb.release_scheduled = true;
        let at = rb.release_not_before_ns.max(now_ns);
        self.q.push(at, Ev::Release { rebuild: r as u32 });
    }

    /// Releases rebuild `r`'s old volume if its copy is done, no request uses it and its
    /// `overlap_s` has passed (otherwise schedules a look when it will have).
    fn maybe_release(&mut self, r: usize, now_ns: u64) {
        let rb = &mut self.rb.list[r];
        if rb.released || !rb.copied() || rb.old_requests > 0 {
            return;
        }
        if now_ns < rb.release_not_before_ns {
            self.schedule_release(r, now_ns);
            return;
        }
        rb.released = true;
        let (ti, old, started_ns) = (rb.tenant as usize, rb.old, rb.started_ns);
        for (w, _, _) in self.shares(ti) {
            self.workers[w].policy.remove_volume(now_ns, old);
        }
        self.rb.of_tenant[ti] = NONE;
        self.bill_overlap(ti, now_ns - started_ns);
    }

    /// Bills the old volume of tenant `ti` for `overlap_ns` beyond its replacement.
    fn bill_overlap(&mut self, ti: usize, overlap_ns: u64) {
        let group = self.tenants[ti].group as usize;
        let gib = self.spec.groups[group].volume_gib;
        let g = &mut self.groups[group];
        g.provisioned_gib_s += gib * overlap_ns as f64 / NS_PER_S_F;
        if let Some(st) = g.rebuild.as_mut() {
            st.overlap_ns_sum += overlap_ns;
        }
    }

    /// Bills every old volume still held at the end of the run up to the end.
    pub(in crate::node) fn bill_unreleased(&mut self) {
        for r in 0..self.rb.list.len() {
            let rb = &self.rb.list[r];
            if !rb.released {
                let (ti, started_ns) = (rb.tenant as usize, rb.started_ns);
                self.bill_overlap(ti, self.end_ns.saturating_sub(started_ns));
            }
        }
    }
}
