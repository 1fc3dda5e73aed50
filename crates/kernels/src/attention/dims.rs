//! The sizes of an attention call, shared by the launches of every kernel family.

/// The sizes of an attention call.
pub(crate) struct Dims {
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads: `heads`, or a divisor of it (grouped-query attention).
    pub kv_heads: usize,
    /// Query heads per key/value head, `heads / kv_heads`.
    pub group: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub hd: usize,
}
