//! The streams a worker's tick watches, with what each waits for kept in time order.
//!
//! A tick needs the streams due now and the time of the next thing due. Walking every watched
//! stream for both cost ≈ 30 instructions a stream at every tick and every admission: with a few
//! hundred streams in flight on a worker, the guard's largest cost. Here each stream's next deadline
//! or reset ([`StreamWatch::due_ns`], a time that changes only when the stream does) is kept in a
//! vector sorted by time, and the held streams (looked at on every tick) in one of their own, so a
//! tick reads the due streams off the front. A sorted vector rather than a heap: an entry is moved
//! when its stream's time changes (a binary search and a shift of the entries after it, a few
//! hundred bytes), nothing stale is ever kept, and it adds less code to the playground's page.
//!
//! Every change to a stream's machine goes through [`Watchlist::update`], which files the stream
//! again when its due time changed.
//!
//! [`StreamWatch::due_ns`]: crate::latency::StreamWatch::due_ns

use super::Watch;
use crate::latency::deadline;
use crate::vecmap::VecMap;

#[derive(Debug, Default)]
pub(super) struct Watchlist {
    streams: VecMap<u32, Box<Watch>>,
    /// `(due_ns, id)` of every stream that waits for a time, ascending: one entry a stream, at its
    /// [`Watch::filed_due_ns`].
    due: Vec<(u64, u32)>,
    /// The held streams' ids, ascending: due at every tick. `u64`, as the ids a tick gathers, for
    /// the standard library's one `[u64]` sort the page's crates share (`crate::sort`).
    held: Vec<u64>,
}

impl Watchlist {
    pub(super) fn get(&self, id: u32) -> Option<&Watch> {
        self.streams.get(&id).map(|w| &**w)
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.streams.keys().copied()
    }

    pub(super) fn insert(&mut self, id: u32, watch: Box<Watch>) {
        self.remove(id);
        self.streams.insert(id, watch);
        self.refile(id);
    }

    pub(super) fn remove(&mut self, id: u32) -> Option<Box<Watch>> {
        let watch = self.streams.remove(&id)?;
        if let Some(at) = watch.filed_due_ns {
            unfile(&mut self.due, (at, id));
        }
        unfile(&mut self.held, u64::from(id));
        Some(watch)
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
            file(&mut self.held, u64::from(id));
        } else {
            unfile(&mut self.held, u64::from(id));
        }
        let due = w.machine.due_ns();
        if due == w.filed_due_ns {
            return;
        }
        if let Some(at) = std::mem::replace(&mut w.filed_due_ns, due) {
            unfile(&mut self.due, (at, id));
        }
        if let Some(at) = due {
            file(&mut self.due, (at, id));
        }
    }

    /// The streams a tick at `now` acts on — the held ones and those whose due time has come — in
    /// ascending id order (the order a walk of every stream gave). One allocation: a tick visits
    /// them one after the other.
    pub(super) fn due_ids(&self, now: u64) -> impl Iterator<Item = u32> {
        let due = self.due.iter().take_while(|&&(at, _)| at <= now).map(|&(_, id)| u64::from(id));
        let mut wide = Vec::with_capacity(self.held.len() + due.clone().count());
        wide.extend_from_slice(&self.held);
        wide.extend(due);
        wide.sort_unstable();
        wide.dedup();
        #[cfg(test)]
        assert_eq!(
            wide.iter().map(|&id| id as u32).collect::<Vec<_>>(),
            self.streams.iter().filter(|(_, w)| w.machine.tick_due(now)).map(|(&id, _)| id).collect::<Vec<_>>(),
            "due streams at {now}"
        );
        wide.into_iter().filter_map(|id| u32::try_from(id).ok())
    }

    /// The earliest time anything watched is due: a held stream's poll
    /// ([`deadline::held_poll_ns`] after `now`) or a stream's deadline or reset.
    pub(super) fn next_due_ns(&self, now: u64, woken_at_first_token: bool) -> Option<u64> {
        let poll = (!self.held.is_empty()).then(|| now.saturating_add(deadline::held_poll_ns(woken_at_first_token)));
        let next = [poll, self.due.first().map(|&(at, _)| at)].into_iter().flatten().min();
        #[cfg(test)]
        assert_eq!(next, self.streams.values().filter_map(|w| w.machine.next_due_ns(now, woken_at_first_token)).min(), "next due after {now}");
        next
    }

    #[cfg(test)]
    pub(super) fn filed_len(&self) -> usize {
        self.due.len()
    }
}

/// Puts `item` in the sorted `list` (once).
fn file<T: Ord>(list: &mut Vec<T>, item: T) {
    if let Err(at) = list.binary_search(&item) {
        list.insert(at, item);
    }
}

/// Takes `item` out of the sorted `list`.
fn unfile<T: Ord>(list: &mut Vec<T>, item: T) {
    if let Ok(at) = list.binary_search(&item) {
        list.remove(at);
    }
}
