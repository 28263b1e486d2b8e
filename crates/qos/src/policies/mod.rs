//! The six policies. Five share the ring engine (`crate::engine`); mClock orders by tags.

mod base;
pub(crate) mod burst;
pub(crate) mod credit;
mod drr;
mod mclock;
mod wild;

use crate::engine::Engine;
use crate::policy::{Policy, PolicyKind, PolicyParams};
use crate::vocab::NodeCapacity;

pub(crate) fn build(
    kind: PolicyKind,
    capacity: NodeCapacity,
    params: &PolicyParams,
) -> Box<dyn Policy> {
    let (w, depth_ns) = (params.window_ns, params.limiter_depth_ns);
    match kind {
        PolicyKind::Wild => Box::new(Engine::new(
            wild::WildRules { depth_ns },
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::Base => Box::new(Engine::new(
            base::BaseRules { depth_ns },
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::Credit => Box::new(Engine::new(
            credit::CreditRules { depth_ns },
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::Burst => Box::new(Engine::new(
            burst::BurstRules::new(capacity, params),
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::MClock => Box::new(mclock::MClock::new(capacity, w, depth_ns)),
        PolicyKind::DrrVop => Box::new(Engine::new(
            drr::DrrRules::new(params),
            capacity,
            w,
            depth_ns,
        )),
    }
}
