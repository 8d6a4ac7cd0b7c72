//! One shard's value: its events and each subscriber's mark, the binary record format, and
//! the rules a request applies to them (claim before the calls, settle after, expire, evict).

use crate::config::SHARD_CAPACITY;

/// Record format version, the first byte of every shard value.
pub(super) const FORMAT: u8 = 1;
const TAG_DELIVERED: u8 = 1;
const TAG_CLAIMED: u8 = 2;

/// One event as the store knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredEvent<'a> {
    pub channel: &'a str,
    pub key: &'a [u8],
}

/// What one subscriber's record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// It answered 2xx at `at_ms`; forgotten at `at_ms + ttl_ms`.
    Delivered { at_ms: u64 },
    /// A request (`owner`) is calling it; the claim lapses at `until_ms`.
    Claimed { until_ms: u64, owner: u64 },
}

impl Mark {
    fn live(&self, now_ms: u64, ttl_ms: u64) -> bool {
        match *self {
            Mark::Delivered { at_ms } => now_ms < at_ms.saturating_add(ttl_ms),
            Mark::Claimed { until_ms, .. } => now_ms < until_ms,
        }
    }
}

/// One event's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub channel: String,
    pub key: Vec<u8>,
    /// When the event was first recorded: the eviction order.
    pub created_ms: u64,
    /// Subscriber identity and its mark.
    pub marks: Vec<(u64, Mark)>,
}

impl Entry {
    fn is(&self, event: &StoredEvent<'_>) -> bool {
        self.channel == event.channel && self.key == event.key
    }

    pub(super) fn mark(&self, id: u64) -> Option<&Mark> {
        self.marks.iter().find(|(i, _)| *i == id).map(|(_, m)| m)
    }

    fn set(&mut self, id: u64, mark: Mark) {
        match self.marks.iter_mut().find(|(i, _)| *i == id) {
            Some(slot) => slot.1 = mark,
            None => self.marks.push((id, mark)),
        }
    }
}

/// What a request does about one subscriber, decided by [`Shard::claim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Not recorded (or expired): this request calls it (it now holds the claim).
    Deliver,
    /// It already took the event: skip it.
    AlreadyDelivered,
    /// Another request is calling it right now: skip it, and do not claim success for it.
    InProgress,
}

/// The value of one shard key: its events, in the order they were first recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shard {
    pub entries: Vec<Entry>,
}

/// A shard value that does not decode (another format, or damage): it is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

impl Shard {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + self.entries.len() * 96);
        out.push(FORMAT);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.created_ms.to_le_bytes());
            put_bytes(&mut out, e.channel.as_bytes());
            put_bytes(&mut out, &e.key);
            out.extend_from_slice(&(e.marks.len() as u16).to_le_bytes());
            for (id, mark) in &e.marks {
                out.extend_from_slice(&id.to_le_bytes());
                match *mark {
                    Mark::Delivered { at_ms } => {
                        out.push(TAG_DELIVERED);
                        out.extend_from_slice(&at_ms.to_le_bytes());
                    }
                    Mark::Claimed { until_ms, owner } => {
                        out.push(TAG_CLAIMED);
                        out.extend_from_slice(&until_ms.to_le_bytes());
                        out.extend_from_slice(&owner.to_le_bytes());
                    }
                }
            }
        }
        out
    }

    /// An empty value is an empty shard (how shard keys are created).
    pub fn decode(bytes: &[u8]) -> Result<Shard, Corrupt> {
        if bytes.is_empty() {
            return Ok(Shard::default());
        }
        let mut r = Reader(bytes);
        if r.u8()? != FORMAT {
            return Err(Corrupt);
        }
        let count = r.u32()? as usize;
        let mut entries = Vec::with_capacity(count.min(SHARD_CAPACITY as usize * 2));
        for _ in 0..count {
            let created_ms = r.u64()?;
            let channel = String::from_utf8(r.bytes()?.to_vec()).map_err(|_| Corrupt)?;
            let key = r.bytes()?.to_vec();
            let n = r.u16()? as usize;
            let mut marks = Vec::with_capacity(n);
            for _ in 0..n {
                let id = r.u64()?;
                let mark = match r.u8()? {
                    TAG_DELIVERED => Mark::Delivered { at_ms: r.u64()? },
                    TAG_CLAIMED => Mark::Claimed {
                        until_ms: r.u64()?,
                        owner: r.u64()?,
                    },
                    _ => return Err(Corrupt),
                };
                marks.push((id, mark));
            }
            entries.push(Entry {
                channel,
                key,
                created_ms,
                marks,
            });
        }
        if !r.0.is_empty() {
            return Err(Corrupt);
        }
        Ok(Shard { entries })
    }

    /// Forgets what has expired: deliveries older than `ttl_ms`, lapsed claims, and events
    /// with nothing left.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        for e in &mut self.entries {
            e.marks.retain(|(_, m)| m.live(now_ms, ttl_ms));
        }
        self.entries.retain(|e| !e.marks.is_empty());
    }

    /// Evicts the oldest events (by first record) until at most `capacity` are left.
    pub fn evict(&mut self, capacity: usize) {
        while self.entries.len() > capacity {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(i, e)| (e.created_ms, *i))
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.entries.remove(i);
                }
                None => break,
            }
        }
    }

    /// The event's entry, created if it has none (always `Some`).
    fn entry_mut(&mut self, event: &StoredEvent<'_>, now_ms: u64) -> Option<&mut Entry> {
        let index = match self.entries.iter().position(|e| e.is(event)) {
            Some(i) => i,
            None => {
                self.entries.push(Entry {
                    channel: event.channel.to_string(),
                    key: event.key.to_vec(),
                    created_ms: now_ms,
                    marks: Vec::new(),
                });
                self.entries.len().saturating_sub(1)
            }
        };
        self.entries.get_mut(index)
    }

    /// Decides, for each subscriber (`ids[i]`, whose claim would last until
    /// `claim_until[i]`), whether this request calls it, and claims those it will call.
    /// Returns the decisions and whether the shard changed (and must be written).
    pub fn claim(
        &mut self,
        event: &StoredEvent<'_>,
        ids: &[u64],
        claim_until: &[u64],
        owner: u64,
        now_ms: u64,
        limits: Limits,
    ) -> (Vec<Seen>, bool) {
        self.expire(now_ms, limits.ttl_ms);
        let existing = self.entries.iter().find(|e| e.is(event));
        let seen: Vec<Seen> = ids
            .iter()
            .map(|id| match existing.and_then(|e| e.mark(*id)) {
                Some(Mark::Delivered { .. }) => Seen::AlreadyDelivered,
                Some(Mark::Claimed { .. }) => Seen::InProgress,
                None => Seen::Deliver,
            })
            .collect();
        if !seen.contains(&Seen::Deliver) {
            return (seen, false);
        }
        if let Some(entry) = self.entry_mut(event, now_ms) {
            for ((id, until), s) in ids.iter().zip(claim_until).zip(&seen) {
                if *s == Seen::Deliver {
                    entry.set(
                        *id,
                        Mark::Claimed {
                            until_ms: *until,
                            owner,
                        },
                    );
                }
            }
        }
        self.evict(limits.capacity);
        (seen, true)
    }

    /// Settles `owner`'s claims: each `(id, delivered)` becomes *delivered now*, or, when the
    /// call did not deliver, the claim is dropped (only if it is still `owner`'s) so that a
    /// retry calls that subscriber again. Returns whether the shard changed.
    pub fn settle(
        &mut self,
        event: &StoredEvent<'_>,
        outcomes: &[(u64, bool)],
        owner: u64,
        now_ms: u64,
        limits: Limits,
    ) -> bool {
        self.expire(now_ms, limits.ttl_ms);
        let mut changed = false;
        if outcomes.iter().any(|(_, delivered)| *delivered) {
            if let Some(entry) = self.entry_mut(event, now_ms) {
                for (id, _) in outcomes.iter().filter(|(_, d)| *d) {
                    entry.set(*id, Mark::Delivered { at_ms: now_ms });
                }
            }
            changed = true;
        }
        if let Some(entry) = self.entries.iter_mut().find(|e| e.is(event)) {
            let before = entry.marks.len();
            entry.marks.retain(|(id, mark)| {
                let ours_failed = outcomes.iter().any(|(o, d)| o == id && !d);
                !(ours_failed && matches!(mark, Mark::Claimed { owner: o, .. } if *o == owner))
            });
            changed |= entry.marks.len() != before;
        }
        self.entries.retain(|e| !e.marks.is_empty());
        self.evict(limits.capacity);
        changed
    }
}

/// What bounds a shard: its capacity and the configured ttl.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub capacity: usize,
    pub ttl_ms: u64,
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Channel names and keys are far below 64 KiB (keys are cut off at MAX_KEY_BYTES).
    let len = bytes.len().min(u16::MAX as usize);
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(bytes.get(..len).unwrap_or_default());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if self.0.len() < n {
            return Err(Corrupt);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        self.take(N)?.try_into().map_err(|_| Corrupt)
    }
    fn u8(&mut self) -> Result<u8, Corrupt> {
        Ok(u8::from_le_bytes(self.array()?))
    }
    fn u16(&mut self) -> Result<u16, Corrupt> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, Corrupt> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, Corrupt> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn bytes(&mut self) -> Result<&'a [u8], Corrupt> {
        let n = self.u16()? as usize;
        self.take(n)
    }
}
