//! The request pipeline in process: nanoseconds and heap allocations per request, from a
//! typed request to its reply, on a RAM-store volume (`headroom_node::server::bench_support`).
//!
//! Why: this is the instrument the hot path's cuts are measured with. A whole server under fio
//! is dominated by the socket, the kernel and fio; here the node is assembled as the server
//! assembles it, with no listener, and one client drives it through the in-memory transport
//! (4 KiB READ and WRITE, policy `burst` on a volume whose QoS never binds and policy `off`,
//! one request at a time and 32 in flight) or through the real NBD session over an in-memory
//! stream (4 KiB READ at QD32, so the parse and the encode are counted too). Each case's node
//! is built once, outside the timed loop, which runs only requests.
//!
//! Allocations: a counting wrapper over the system allocator counts every allocation on every
//! thread; before each case's timing, 10,000 requests (after 2,000 to warm the pools) are
//! counted and "allocations per request" is printed. The memory transport's own API accounts
//! for one per request: a WRITE's `Vec` payload the client builds, a READ's `Vec` of data.
//! Timing on this shared machine moves with the neighbours' load; instructions
//! (`scripts/count-pipeline-instructions`) do not.
//!
//! ```text
//! cargo bench -p headroom-node --bench pipeline -- --warm-up-time 1 --measurement-time 3
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use headroom_node::server::bench_support::{Case, CaseDriver};

/// Requests run before counting, so pools and queues are at size.
const WARM_UP_REQUESTS: u64 = 2_000;
/// Requests whose allocations are counted.
const COUNTED_REQUESTS: u64 = 10_000;

/// The system allocator, counting calls that allocate (`alloc`, `alloc_zeroed`, `realloc`).
struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// is a relaxed atomic, which allocates nothing.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `GlobalAlloc::alloc` is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ptr` and `layout` came from this allocator, that is from `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Allocations per request over [`COUNTED_REQUESTS`] requests of `driver`'s case.
fn allocations_per_request(driver: &mut CaseDriver) -> f64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    driver.run(COUNTED_REQUESTS);
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    allocations as f64 / COUNTED_REQUESTS as f64
}

fn pipeline(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline");
    for case in Case::all() {
        let name = case.name();
        let mut driver = CaseDriver::new(case);
        driver.run(WARM_UP_REQUESTS);
        let allocations = allocations_per_request(&mut driver);
        println!("{name}: allocations per request: {allocations:.2}");
        group.bench_function(name, |bencher| {
            bencher.iter_custom(|requests| {
                let start = Instant::now();
                driver.run(requests);
                start.elapsed()
            });
        });
    }
    group.finish();
}

criterion_group!(benches, pipeline);
criterion_main!(benches);
