//! The wasm build's allocator: small blocks by size class, larger ones from the system allocator.
//!
//! A request makes a few hundred short-lived small allocations (header values, names, keys, stamp
//! text, parsed JSON). wasi-libc's dlmalloc spends about a quarter of the guest's time on them
//! (splitting, coalescing, bins); here an allocation of at most [`LARGEST_CLASS`] bytes is a pop from
//! its class's free list and a release is a push. Blocks are carved from chunks taken from the system
//! allocator and never handed back: the memory of each class is bounded by the most blocks of that
//! class ever live at once, so a stream of 100k events reuses the blocks of the first.
//!
//! Not thread-safe: a proxy-wasm VM runs one thread, and the global instance exists only in the
//! wasm32 build (native builds and tests use the platform allocator; the tests below drive a local
//! [`Blocks`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

/// The smallest block: holds the free-list link and keeps every block 16-byte aligned.
const SMALLEST_SHIFT: u32 = 4;
/// Classes 16, 32, …, 4096 bytes.
const CLASSES: usize = 9;
/// The largest size (or alignment) served from a class.
pub const LARGEST_CLASS: usize = 1 << (SMALLEST_SHIFT as usize + CLASSES - 1);
/// Bytes taken from the system allocator at a time for one class (at least one block).
const CHUNK_BYTES: usize = 16 * 1024;

/// The class that serves `layout`, or `None` when the system allocator does.
fn class_of(layout: Layout) -> Option<usize> {
    let need = layout.size().max(layout.align());
    if need > LARGEST_CLASS {
        return None;
    }
    let rounded = need.max(1 << SMALLEST_SHIFT).next_power_of_two();
    Some((rounded.trailing_zeros() - SMALLEST_SHIFT) as usize)
}

fn class_bytes(class: usize) -> usize {
    1 << (SMALLEST_SHIFT as usize + class)
}

struct Class {
    /// Freed blocks, linked through their first word.
    free: *mut u8,
    /// The uncarved rest of the newest chunk.
    next: *mut u8,
    end: *mut u8,
}

/// The allocator's state.
pub struct Blocks {
    classes: UnsafeCell<[Class; CLASSES]>,
}

// SAFETY: a proxy-wasm VM is single-threaded; the global instance is only compiled for wasm32,
// where no other thread exists.
unsafe impl Sync for Blocks {}

impl Blocks {
    pub const fn new() -> Self {
        const EMPTY: Class = Class { free: ptr::null_mut(), next: ptr::null_mut(), end: ptr::null_mut() };
        Blocks { classes: UnsafeCell::new([EMPTY; CLASSES]) }
    }

    /// # Safety
    /// Single-threaded use only (see the type's note).
    #[inline]
    unsafe fn take(&self, class: usize) -> *mut u8 {
        // SAFETY: single-threaded, and no reference into `classes` outlives this call.
        let Some(slot) = (unsafe { (*self.classes.get()).get_mut(class) }) else {
            return ptr::null_mut();
        };
        if slot.free.is_null() {
            return carve(slot, class_bytes(class));
        }
        let block = slot.free;
        // SAFETY: a block on the free list was ours, is at least 16 bytes and 16-aligned, and
        // holds the next link written by `give`.
        slot.free = unsafe { block.cast::<*mut u8>().read() };
        block
    }

    /// # Safety
    /// `block` came from `take(class)` and is not used again; single-threaded use only.
    #[inline]
    unsafe fn give(&self, class: usize, block: *mut u8) {
        // SAFETY: as for `take`.
        let Some(slot) = (unsafe { (*self.classes.get()).get_mut(class) }) else {
            return;
        };
        // SAFETY: the block is ours, at least 16 bytes and 16-aligned.
        unsafe { block.cast::<*mut u8>().write(slot.free) };
        slot.free = block;
    }
}

/// A new block of `size` bytes from the class's chunk, taking a new chunk when it is used up.
fn carve(slot: &mut Class, size: usize) -> *mut u8 {
    if (slot.end as usize).saturating_sub(slot.next as usize) < size {
        let chunk = CHUNK_BYTES.max(size);
        let Ok(layout) = Layout::from_size_align(chunk, size) else {
            return ptr::null_mut();
        };
        // SAFETY: the layout has a non-zero size.
        let fresh = unsafe { System.alloc(layout) };
        if fresh.is_null() {
            return ptr::null_mut();
        }
        slot.next = fresh;
        // SAFETY: `chunk` bytes were allocated at `fresh`.
        slot.end = unsafe { fresh.add(chunk) };
    }
    let block = slot.next;
    // SAFETY: at least `size` bytes remain before `end`.
    slot.next = unsafe { block.add(size) };
    block
}

impl Default for Blocks {
    fn default() -> Self {
        Self::new()
    }
}

// The three entry points are kept out of line: inlined into every allocation site (LTO), they
// made sluice.wasm 17 % larger (1.46 MB against 1.25) for 3 % less fuel.
//
// SAFETY: every block handed out is at least `layout.size()` bytes, aligned to its class size,
// which is at least `layout.align()`; a block is reused only after `dealloc` gave it back, and the
// class is recomputed from the same layout Rust passes to `dealloc`.
unsafe impl GlobalAlloc for Blocks {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match class_of(layout) {
            // SAFETY: single-threaded (see the type's note).
            Some(class) => unsafe { self.take(class) },
            // SAFETY: the caller's contract is System's.
            None => unsafe { System.alloc(layout) },
        }
    }

    #[inline(never)]
    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        match class_of(layout) {
            // SAFETY: `block` was allocated with this layout, so from this class.
            Some(class) => unsafe { self.give(class, block) },
            // SAFETY: allocated by System with this layout.
            None => unsafe { System.dealloc(block, layout) },
        }
    }

    #[inline(never)]
    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return ptr::null_mut();
        };
        match (class_of(layout), class_of(new_layout)) {
            (Some(old), Some(new)) if old == new => block,
            // SAFETY: both sides are System's, with the caller's contract.
            (None, None) => unsafe { System.realloc(block, layout, new_size) },
            _ => {
                // SAFETY: the new layout has a non-zero size (realloc's contract).
                let moved = unsafe { self.alloc(new_layout) };
                if !moved.is_null() {
                    // SAFETY: both blocks are valid for the smaller size and do not overlap.
                    unsafe {
                        ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                }
                moved
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_alignments_map_to_the_smallest_class_that_holds_them() {
        let class = |size, align| class_of(Layout::from_size_align(size, align).unwrap());
        assert_eq!(class(1, 1), Some(0));
        assert_eq!(class(16, 8), Some(0));
        assert_eq!(class(17, 1), Some(1));
        assert_eq!(class(8, 64), Some(2));
        assert_eq!(class(4096, 1), Some(8));
        assert_eq!(class(4097, 1), None);
        assert_eq!(class(16, 8192), None);
    }

    #[test]
    fn blocks_are_aligned_disjoint_and_reused_after_release() {
        let blocks = Blocks::new();
        let mut live = Vec::new();
        for (i, (size, align)) in [(1, 1), (24, 8), (100, 4), (64, 64), (3000, 16), (5000, 8), (40, 8), (16, 16)].iter().cycle().take(400).enumerate() {
            let layout = Layout::from_size_align(*size, *align).unwrap();
            let p = unsafe { blocks.alloc(layout) };
            assert!(!p.is_null());
            assert_eq!(p as usize % align, 0);
            unsafe { ptr::write_bytes(p, i as u8, *size) };
            live.push((p, layout, i as u8));
        }
        // Every block still holds what was written into it: none overlaps another.
        for (p, layout, fill) in &live {
            let bytes = unsafe { std::slice::from_raw_parts(*p, layout.size()) };
            assert!(bytes.iter().all(|b| b == fill));
        }
        let small: std::collections::BTreeSet<usize> = live.iter().filter(|(_, layout, _)| class_of(*layout).is_some()).map(|(p, _, _)| *p as usize).collect();
        let layouts: Vec<Layout> = live.iter().map(|(_, layout, _)| *layout).collect();
        for (p, layout, _) in live.drain(..) {
            unsafe { blocks.dealloc(p, layout) };
        }
        // The same allocations again are served from the released blocks, not new memory.
        for layout in layouts.iter().filter(|l| class_of(**l).is_some()) {
            let p = unsafe { blocks.alloc(*layout) };
            assert!(small.contains(&(p as usize)));
        }
    }

    #[test]
    fn a_released_block_is_the_next_one_of_its_class() {
        let blocks = Blocks::new();
        let layout = Layout::from_size_align(48, 8).unwrap();
        let a = unsafe { blocks.alloc(layout) };
        let b = unsafe { blocks.alloc(layout) };
        assert_ne!(a, b);
        unsafe { blocks.dealloc(a, layout) };
        assert_eq!(unsafe { blocks.alloc(layout) }, a);
        unsafe {
            blocks.dealloc(a, layout);
            blocks.dealloc(b, layout);
        }
    }

    #[test]
    fn realloc_keeps_the_contents_across_classes_and_into_the_system_allocator() {
        let blocks = Blocks::new();
        let mut layout = Layout::from_size_align(10, 1).unwrap();
        let mut p = unsafe { blocks.alloc(layout) };
        for i in 0..10u8 {
            unsafe { p.add(i as usize).write(i) };
        }
        for new_size in [12, 15, 40, 1000, 4096, 9000, 20000, 3000, 10] {
            let same_class = class_of(layout) == class_of(Layout::from_size_align(new_size, 1).unwrap()) && class_of(layout).is_some();
            let q = unsafe { blocks.realloc(p, layout, new_size) };
            assert!(!q.is_null());
            if same_class {
                assert_eq!(q, p, "a size within the class keeps its block");
            }
            let kept = layout.size().min(new_size).min(10);
            let bytes = unsafe { std::slice::from_raw_parts(q, kept) };
            assert_eq!(bytes, &(0..kept as u8).collect::<Vec<_>>()[..]);
            p = q;
            layout = Layout::from_size_align(new_size, 1).unwrap();
        }
        unsafe { blocks.dealloc(p, layout) };
    }

    #[test]
    fn a_steady_workload_takes_no_new_chunks() {
        // The same pattern of live blocks, repeated, is served from the free lists: the bump
        // pointers stop moving after the first round.
        let blocks = Blocks::new();
        let layouts: Vec<Layout> = [8usize, 33, 200, 700, 2100, 16, 16, 90].iter().map(|s| Layout::from_size_align(*s, 8).unwrap()).collect();
        let round = |blocks: &Blocks| {
            let held: Vec<*mut u8> = layouts.iter().map(|l| unsafe { blocks.alloc(*l) }).collect();
            for (p, l) in held.into_iter().zip(&layouts) {
                unsafe { blocks.dealloc(p, *l) };
            }
        };
        round(&blocks);
        let bumps = || unsafe { (*blocks.classes.get()).iter().map(|c| c.next as usize).collect::<Vec<_>>() };
        let after_first = bumps();
        for _ in 0..1000 {
            round(&blocks);
        }
        assert_eq!(bumps(), after_first);
    }
}
