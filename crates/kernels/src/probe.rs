//! Where the probes of a measuring step leave their samples: one sink for the FP8 health of the
//! FP8 layers' operands ([`crate::Fp8Probe`]) and the format statistics of gradients
//! ([`crate::format_probe`]). Each sample is a name and a measurement still on the device; the
//! reader takes the samples of the kind it reads, in the order they were recorded, and resolves
//! them together after the step.

use std::any::Any;
use std::sync::{Arc, Mutex};

/// One measurement: what was measured, the value (a type each probe documents), and how many
/// elements it covers.
pub struct Sample {
    pub name: String,
    pub value: Box<dyn Any + Send>,
    pub elements: usize,
}

impl std::fmt::Debug for Sample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sample({}, {} elements)", self.name, self.elements)
    }
}

/// The shared list the probes append their [`Sample`]s to.
pub type ProbeSink = Arc<Mutex<Vec<Sample>>>;

/// A new, empty [`ProbeSink`].
pub fn probe_sink() -> ProbeSink {
    Arc::new(Mutex::new(Vec::new()))
}

/// Appends a sample to `sink`.
pub(crate) fn record(sink: &ProbeSink, sample: Sample) {
    sink.lock().unwrap_or_else(|e| e.into_inner()).push(sample);
}

/// Takes the samples whose value is a `T` out of `sink` as `(name, value, elements)`, in the order
/// they were recorded; samples of other kinds stay.
pub fn take<T: Any>(sink: &ProbeSink) -> Vec<(String, T, usize)> {
    let mut all = sink.lock().unwrap_or_else(|e| e.into_inner());
    let (taken, kept): (Vec<Sample>, Vec<Sample>) = std::mem::take(&mut *all)
        .into_iter()
        .partition(|s| s.value.is::<T>());
    *all = kept;
    taken
        .into_iter()
        .map(|s| {
            let value = *s.value.downcast::<T>().expect("partitioned by type");
            (s.name, value, s.elements)
        })
        .collect()
}
