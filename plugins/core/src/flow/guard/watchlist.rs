//! The streams a worker's tick watches, with what each waits for kept in time order.
//!
//! A tick needs the streams due now and the time of the next thing due. Walking every watched
//! stream for both cost ≈ 30 instructions a stream at every tick and every admission: with a few
//! hundred streams in flight on a worker, the guard's largest cost. Here a stream's next deadline
//! or reset ([`StreamWatch::due_ns`], a time that changes only when the stream does) sits in a
//! min-heap, and held streams (looked at on every tick) in a set of their own, so a tick costs
//! `O(k log n)` for `k` due streams of `n`.
//!
//! Every change to a stream's machine goes through [`Watchlist::update`], which re-files the stream
//! when its due time changed: the old heap entry is left behind and skipped as stale when it
//! reaches the top (its stream gone, or filed under another time now). Stale entries are bounded:
//! when they outnumber the streams the heap is rebuilt from the streams, so its size stays within
//! a small multiple of the streams watched whatever the traffic.
//!
//! [`StreamWatch::due_ns`]: crate::latency::StreamWatch::due_ns

use super::Watch;
use crate::latency::deadline;
use crate::vecmap::VecMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Debug, Default)]
pub(super) struct Watchlist {
    streams: VecMap<u32, Box<Watch>>,
    /// `(due_ns, id)` as each stream was last filed; valid while the stream is watched and its
    /// [`Watch::filed_due_ns`] is that time.
    due: BinaryHeap<Reverse<(u64, u32)>>,
    /// The held streams: due at every tick.
    held: VecMap<u32, ()>,
}

impl Watchlist {
    /// Stale heap entries tolerated beyond twice the streams before a rebuild.
    const SLACK: usize = 64;

    pub(super) fn get(&self, id: u32) -> Option<&Watch> {
        self.streams.get(&id).map(|w| &**w)
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.streams.keys().copied()
    }

    pub(super) fn insert(&mut self, id: u32, watch: Box<Watch>) {
        self.streams.insert(id, watch);
        self.refile(id);
    }

    pub(super) fn remove(&mut self, id: u32) -> Option<Box<Watch>> {
        self.held.remove(&id);
        self.streams.remove(&id)
    }

    /// Runs `change` on stream `id` (`None` when it is not watched) and files it again under what
    /// it is due for now. The only way to reach a watched stream's machine mutably.
    pub(super) fn update<R>(&mut self, id: u32, change: impl FnOnce(&mut Watch) -> R) -> Option<R> {
        let result = change(self.streams.get_mut(&id)?);
        self.refile(id);
        Some(result)
    }

    fn refile(&mut self, id: u32) {
        let Some(w) = self.streams.get_mut(&id) else { return };
        if w.machine.is_held() {
            self.held.insert(id, ());
        } else {
            self.held.remove(&id);
        }
        let due = w.machine.due_ns();
        if due == w.filed_due_ns {
            return;
        }
        w.filed_due_ns = due;
        if let Some(at) = due {
            self.due.push(Reverse((at, id)));
            if self.due.len() > self.streams.len().saturating_mul(2).saturating_add(Self::SLACK) {
                self.rebuild();
            }
        }
    }

    fn rebuild(&mut self) {
        self.due = self.streams.iter().filter_map(|(&id, w)| w.filed_due_ns.map(|at| Reverse((at, id)))).collect();
    }

    fn is_filed(&self, at: u64, id: u32) -> bool {
        self.streams.get(&id).is_some_and(|w| w.filed_due_ns == Some(at))
    }

    /// Drops stale entries from the top of the heap: its top is then a watched stream's due time.
    fn drop_stale_top(&mut self) {
        while let Some(&Reverse((at, id))) = self.due.peek() {
            if self.is_filed(at, id) {
                return;
            }
            self.due.pop();
        }
    }

    /// The streams a tick at `now` acts on — the held ones and those whose due time has come — in
    /// ascending id order (the order a walk of every stream gave).
    pub(super) fn due_ids(&mut self, now: u64) -> Vec<u32> {
        let mut ids: Vec<u32> = self.held.keys().copied().collect();
        let mut taken = Vec::new();
        while let Some(&Reverse((at, id))) = self.due.peek() {
            if at > now {
                break;
            }
            self.due.pop();
            if self.is_filed(at, id) {
                ids.push(id);
                taken.push(Reverse((at, id)));
            }
        }
        // Still due until their tick changes them (which files them again).
        self.due.extend(taken);
        ids.sort_unstable();
        ids.dedup();
        #[cfg(test)]
        assert_eq!(ids, self.streams.iter().filter(|(_, w)| w.machine.tick_due(now)).map(|(&id, _)| id).collect::<Vec<_>>(), "due streams at {now}");
        ids
    }

    /// The earliest time anything watched is due: a held stream's poll
    /// ([`deadline::held_poll_ns`] after `now`) or a stream's deadline or reset.
    pub(super) fn next_due_ns(&mut self, now: u64, woken_at_first_token: bool) -> Option<u64> {
        self.drop_stale_top();
        let poll = (!self.held.is_empty()).then(|| now.saturating_add(deadline::held_poll_ns(woken_at_first_token)));
        let next = [poll, self.due.peek().map(|&Reverse((at, _))| at)].into_iter().flatten().min();
        #[cfg(test)]
        assert_eq!(next, self.streams.values().filter_map(|w| w.machine.next_due_ns(now, woken_at_first_token)).min(), "next due after {now}");
        next
    }

    #[cfg(test)]
    pub(super) fn heap_len(&self) -> usize {
        self.due.len()
    }
}
