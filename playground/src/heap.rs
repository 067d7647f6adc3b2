//! The page's allocator: blocks of a power-of-two size, each size with its free list, carved from
//! pages the module grows its memory by and never handed back.
//!
//! The standard library's allocator on this target is dlmalloc, 7 KB of the page (splitting,
//! coalescing, bins) for a module that runs one workload at a time: here an allocation is a pop
//! from its size's free list (or a carve from the newest pages) and a release a push. A block is
//! reused only for its own size, so the memory of each size is bounded by the most blocks of that
//! size ever live at once, the next run reusing the blocks of the last (a page reloads to start
//! over).
//!
//! Not thread-safe: the page's module runs on the browser's one thread, and the global instance
//! exists only in the wasm32 build (natively the platform's allocator; the tests below drive a
//! local [`Heap`] over a buffer).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;
use std::ptr;

/// The smallest block: holds the free-list link and keeps every block 16-byte aligned.
const SMALLEST_SHIFT: u32 = 4;
/// Block sizes 16 bytes … 2 GiB (the most a wasm32 memory can hold).
const SIZES: usize = 28;
/// A wasm page.
pub const PAGE: usize = 64 * 1024;
/// The largest alignment a block keeps beyond its 16 bytes: a block is aligned to its size up to
/// this (pages are, and carving aligns), so any alignment up to the smaller of the two is kept.
const MOST_ALIGNED: usize = PAGE;

/// The free list that serves `layout`, or `None` when no block is large enough.
fn size_of(layout: Layout) -> Option<usize> {
    if layout.align() > MOST_ALIGNED {
        return None;
    }
    let need = layout.size().max(layout.align()).max(1 << SMALLEST_SHIFT).checked_next_power_of_two()?;
    let index = (need.trailing_zeros() - SMALLEST_SHIFT) as usize;
    (index < SIZES).then_some(index)
}

fn block_bytes(index: usize) -> usize {
    1 << (SMALLEST_SHIFT as usize + index)
}

struct State {
    /// Freed blocks of each size, linked through their first word.
    free: [*mut u8; SIZES],
    /// The uncarved rest of the pages grown so far.
    next: usize,
    end: usize,
}

/// The allocator; `grow(pages)` adds that many pages to the memory and returns the address of
/// the first (`memory.grow`'s old size, in bytes; `None` when the memory cannot grow).
pub struct Heap<G> {
    state: UnsafeCell<State>,
    grow: G,
}

// SAFETY: the page's module is single-threaded; the global instance is only compiled for wasm32
// without threads, where no other thread exists.
unsafe impl<G> Sync for Heap<G> {}

impl<G> Heap<G> {
    pub const fn new(grow: G) -> Self {
        Heap { state: UnsafeCell::new(State { free: [ptr::null_mut(); SIZES], next: 0, end: 0 }), grow }
    }
}

impl<G: Fn(usize) -> Option<usize>> Heap<G> {
    /// A new block of `size` bytes, aligned to its size (up to [`MOST_ALIGNED`]), from the pages
    /// grown so far or from new ones.
    fn carve(&self, state: &mut State, size: usize) -> *mut u8 {
        let align = size.min(MOST_ALIGNED);
        let fits = |state: &State| state.next.checked_next_multiple_of(align).filter(|start| start.checked_add(size).is_some_and(|end| end <= state.end));
        if fits(state).is_none() {
            // Enough whole pages for the block: every end is a page boundary, so a block begun in
            // the old tail ends within them when they follow it, and one begun at them when the
            // memory grew in between (then the old tail is left).
            let pages = size.div_ceil(PAGE);
            let Some(at) = (self.grow)(pages) else { return ptr::null_mut() };
            let Some(end) = pages.checked_mul(PAGE).and_then(|bytes| at.checked_add(bytes)) else { return ptr::null_mut() };
            if at != state.end {
                state.next = at;
            }
            state.end = end;
        }
        let Some(start) = fits(state) else { return ptr::null_mut() };
        state.next = start + size;
        ptr::with_exposed_provenance_mut(start)
    }
}

// SAFETY: a block handed out is at least `layout.size()` bytes and aligned to its block size (up to
// a page), which is at least `layout.align()`; it is reused only after `dealloc` gave it back, its
// free list found again from the layout Rust passes to `dealloc`; single-threaded (see `Heap`).
unsafe impl<G: Fn(usize) -> Option<usize>> GlobalAlloc for Heap<G> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(index) = size_of(layout) else { return ptr::null_mut() };
        // SAFETY: single-threaded, and no other reference into the state lives during this call.
        let state = unsafe { &mut *self.state.get() };
        let Some(slot) = state.free.get_mut(index) else { return ptr::null_mut() };
        if !slot.is_null() {
            let block = *slot;
            // SAFETY: a block on the free list is ours, at least 16 bytes and 16-aligned, and holds
            // the next link written by `dealloc`.
            *slot = unsafe { block.cast::<*mut u8>().read() };
            return block;
        }
        self.carve(state, block_bytes(index))
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let Some(index) = size_of(layout) else { return };
        // SAFETY: as for `alloc`.
        let state = unsafe { &mut *self.state.get() };
        let Some(slot) = state.free.get_mut(index) else { return };
        // SAFETY: the block is ours, at least 16 bytes and 16-aligned.
        unsafe { block.cast::<*mut u8>().write(*slot) };
        *slot = block;
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else { return ptr::null_mut() };
        // The same block when the new size needs the same block size.
        if size_of(new_layout).is_some() && size_of(new_layout) == size_of(layout) {
            return block;
        }
        // SAFETY: single-threaded, as the caller promises.
        let moved = unsafe { self.alloc(new_layout) };
        if !moved.is_null() {
            // SAFETY: both blocks are ours and distinct (`moved` was free), each at least as long
            // as the bytes copied.
            unsafe {
                ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                self.dealloc(block, layout);
            }
        }
        moved
    }
}

/// The page's `memory.grow`, in bytes.
#[cfg(target_arch = "wasm32")]
fn grow(pages: usize) -> Option<usize> {
    let old = core::arch::wasm32::memory_grow(0, pages);
    if old == usize::MAX {
        return None;
    }
    old.checked_mul(PAGE)
}

#[cfg(target_arch = "wasm32")]
#[global_allocator]
static HEAP: Heap<fn(usize) -> Option<usize>> = Heap::new(grow);

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A memory of `pages` pages for a [`Heap`]; `gap` pages are skipped at the `gap_at`th growth
    /// (something else grew the memory in between).
    struct Memory {
        base: *mut u8,
        pages: usize,
        used: Cell<usize>,
        growths: Cell<usize>,
    }

    impl Memory {
        fn new(pages: usize) -> Memory {
            let layout = Layout::from_size_align(pages * PAGE, PAGE).unwrap();
            // SAFETY: a non-zero size.
            let base = unsafe { std::alloc::alloc(layout) };
            assert!(!base.is_null());
            Memory { base, pages, used: Cell::new(1), growths: Cell::new(0) }
        }

        fn grow(&self, pages: usize, gap_at: usize) -> Option<usize> {
            let n = self.growths.get();
            self.growths.set(n + 1);
            if n == gap_at {
                self.used.set(self.used.get() + 3);
            }
            let old = self.used.get();
            (old + pages <= self.pages).then(|| {
                self.used.set(old + pages);
                self.base as usize + old * PAGE
            })
        }
    }

    impl Drop for Memory {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.base, Layout::from_size_align(self.pages * PAGE, PAGE).unwrap()) };
        }
    }

    /// xorshift64: the test's own reproducible choices.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn blocks_are_aligned_disjoint_kept_across_realloc_and_reused() {
        for gap_at in [usize::MAX, 0, 5] {
            let memory = Memory::new(1024);
            let heap = Heap::new(|pages| memory.grow(pages, gap_at));
            let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
            // Live blocks: address, layout, the byte each was filled with.
            let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
            for round in 0..20_000u32 {
                let r = next(&mut rng);
                if live.len() > 200 || (r.is_multiple_of(3) && !live.is_empty()) {
                    let (block, layout, fill) = live.swap_remove((r >> 8) as usize % live.len());
                    // SAFETY: a live block of this layout.
                    let bytes = unsafe { std::slice::from_raw_parts(block, layout.size()) };
                    assert!(bytes.iter().all(|&b| b == fill), "block overwritten");
                    if r.is_multiple_of(2) {
                        // SAFETY: from this heap with this layout.
                        unsafe { heap.dealloc(block, layout) };
                    } else {
                        let new_size = 1 + (next(&mut rng) % 9000) as usize;
                        // SAFETY: from this heap with this layout; a non-zero size.
                        let moved = unsafe { heap.realloc(block, layout, new_size) };
                        assert!(!moved.is_null());
                        let kept = layout.size().min(new_size);
                        // SAFETY: the first `kept` bytes of the resized block.
                        let bytes = unsafe { std::slice::from_raw_parts(moved, kept) };
                        assert!(bytes.iter().all(|&b| b == fill), "realloc lost bytes");
                        let layout = Layout::from_size_align(new_size, layout.align()).unwrap();
                        // SAFETY: the block is `new_size` bytes.
                        unsafe { ptr::write_bytes(moved, fill, new_size) };
                        live.push((moved, layout, fill));
                    }
                } else {
                    let size = match r % 10 {
                        0 => 1 + (r >> 16) as usize % 70_000,
                        _ => 1 + (r >> 16) as usize % 300,
                    };
                    let align = [1, 2, 4, 8, 16, 32, 64, 4096][(r >> 40) as usize % 8];
                    let layout = Layout::from_size_align(size, align).unwrap();
                    // SAFETY: a non-zero size.
                    let block = unsafe { heap.alloc(layout) };
                    assert!(!block.is_null());
                    assert_eq!(block as usize % align, 0, "misaligned for {layout:?}");
                    let fill = (round % 251) as u8;
                    // SAFETY: the block is `size` bytes.
                    unsafe { ptr::write_bytes(block, fill, size) };
                    live.push((block, layout, fill));
                }
                let mut spans: Vec<(usize, usize)> = live.iter().map(|(b, l, _)| (*b as usize, *b as usize + l.size())).collect();
                spans.sort_unstable();
                assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "blocks overlap");
            }
            // Freed blocks are reused: the memory grown stays far below what was allocated.
            assert!(memory.used.get() < 600, "{} pages", memory.used.get());
        }
    }

    #[test]
    fn an_exhausted_memory_is_a_null_block() {
        let memory = Memory::new(4);
        let heap = Heap::new(|pages| memory.grow(pages, usize::MAX));
        let layout = Layout::from_size_align(5 * PAGE, 8).unwrap();
        // SAFETY: a non-zero size.
        assert!(unsafe { heap.alloc(layout) }.is_null());
        assert_eq!(size_of(Layout::from_size_align(1, 2 * PAGE).unwrap()), None);
        assert_eq!(size_of(Layout::from_size_align(1, 1).unwrap()), Some(0));
        assert_eq!(size_of(Layout::from_size_align(17, 1).unwrap()), Some(1));
        assert_eq!(size_of(Layout::from_size_align(16, 64).unwrap()), Some(2));
    }
}
