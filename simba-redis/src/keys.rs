//! Key and channel names.

/// The separator of Simba's Redis messages (`event@@contenderId`, as the JVM Simba writes
/// them): a contender id on Redis must not contain it, or its messages could not be read
/// back.
pub const MESSAGE_SEPARATOR: &str = "@@";

/// What the handoff channel of a mutex adds to its mutex channel (the release script
/// spells it out too).
pub(crate) const HANDOFF_CHANNEL_SUFFIX: &str = ":@@handoff";

/// What a semaphore waiter's own channel has after the name's part (`P:{S}:@@sem:w:<id>`).
pub(crate) const SEMAPHORE_WAITER: &str = ":@@sem:w:";

/// How the keys and channels of a mutex are named.
#[derive(Debug, Clone)]
pub(crate) struct KeySpace {
    prefix: String,
    hash_tag: bool,
}

impl KeySpace {
    pub(crate) fn new(prefix: &str, hash_tag: bool) -> Self {
        KeySpace {
            prefix: prefix.to_owned(),
            hash_tag,
        }
    }

    /// The owner key `P:{M}`, which is also the mutex channel.
    pub(crate) fn owner(&self, mutex: &str) -> String {
        if self.hash_tag {
            format!("{}:{{{mutex}}}", self.prefix)
        } else {
            format!("{}:{mutex}", self.prefix)
        }
    }

    /// Every key of a mutex, in the order the scripts expect them (`KEYS[1..7]`): owner,
    /// owner metadata, wait queue, waiter expiry, fence counter, handoff reservation,
    /// primary marker (the failover quarantine's).
    pub(crate) fn keys(&self, mutex: &str) -> Vec<String> {
        let owner = self.owner(mutex);
        let others = [
            ":owner",
            ":contender",
            ":contender:expires",
            ":fence",
            ":handoff",
            ":primary",
        ]
        .map(|suffix| format!("{owner}{suffix}"));
        let mut keys = Vec::with_capacity(8);
        keys.push(owner);
        keys.extend(others);
        keys
    }

    /// Every key of a semaphore, in the order its scripts expect them (`KEYS[1..6]`, see
    /// `sem_common.lua`): holders (also the channel of a release that woke no waiter),
    /// data, wait queue, waiter expiry, fence counter, claims. They carry the name's hash tag, as a
    /// mutex's keys do, under `:@@sem`, which no mutex key or contender channel has
    /// (contender ids cannot contain `@@`): a semaphore and a mutex of one name are apart.
    pub(crate) fn semaphore_keys(&self, semaphore: &str) -> Vec<String> {
        let holders = format!("{}:@@sem", self.owner(semaphore));
        let mut keys = vec![holders.clone()];
        keys.extend(
            [":data", ":queue", ":expires", ":fence", ":claims"].map(|s| format!("{holders}{s}")),
        );
        keys
    }

    /// The channel on which a waiter for a permit of `semaphore` is woken.
    pub(crate) fn semaphore_waiter_channel(&self, semaphore: &str, contender_id: &str) -> String {
        format!("{}{SEMAPHORE_WAITER}{contender_id}", self.owner(semaphore))
    }

    /// The boot marker `P:{}:boot`: set at the first acquisition a server sees, so that its
    /// absence means the server's data is new (first use, or lost in a restart). The
    /// braces keep it apart from every mutex's keys (mutex names cannot contain them).
    pub(crate) fn boot(&self) -> String {
        format!("{}:{{}}:boot", self.prefix)
    }

    /// The channel on which a release announces the handoff reservation it gave a waiter
    /// (`reserved@@<ms>:<waiter>`). Contender ids cannot contain `@@`, so it is no
    /// contender's channel.
    pub(crate) fn handoff_channel(&self, mutex: &str) -> String {
        format!("{}{HANDOFF_CHANNEL_SUFFIX}", self.owner(mutex))
    }

    /// The channel on which `contender_id` is told that the mutex was handed to it.
    pub(crate) fn contender_channel(&self, mutex: &str, contender_id: &str) -> String {
        format!("{}:{contender_id}", self.owner(mutex))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let k = KeySpace::new("simba", true);
        assert_eq!(k.owner("m"), "simba:{m}");
        assert_eq!(
            k.keys("m"),
            [
                "simba:{m}",
                "simba:{m}:owner",
                "simba:{m}:contender",
                "simba:{m}:contender:expires",
                "simba:{m}:fence",
                "simba:{m}:handoff",
                "simba:{m}:primary"
            ]
        );
        assert_eq!(k.contender_channel("m", "c1"), "simba:{m}:c1");
        assert_eq!(k.handoff_channel("m"), "simba:{m}:@@handoff");
        assert_eq!(k.boot(), "simba:{}:boot");
        assert_eq!(
            k.semaphore_keys("s"),
            [
                "simba:{s}:@@sem",
                "simba:{s}:@@sem:data",
                "simba:{s}:@@sem:queue",
                "simba:{s}:@@sem:expires",
                "simba:{s}:@@sem:fence",
                "simba:{s}:@@sem:claims"
            ]
        );
        assert_eq!(
            k.semaphore_waiter_channel("s", "c1"),
            "simba:{s}:@@sem:w:c1"
        );
        let k = KeySpace::new("app", false);
        assert_eq!(k.owner("m"), "app:m");
        assert_eq!(k.contender_channel("m", "c"), "app:m:c");
    }
}
