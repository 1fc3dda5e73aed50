//! The look-up of CubeCL's own `CUstream`, read from its CUDA server's `Debug` description
//! (CubeCL 0.10 has no accessor) and checked with the driver: what lets work issued outside
//! CubeCL (the GEMMs' `Same` order, the collectives) run on CubeCL's stream, in its order.

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::sys as dsys;

/// Why [`find_cubecl_stream`] found no stream.
pub(crate) enum FindError {
    /// The server's description has no stream pool this can read.
    Description(String),
    /// The pool (of `slots` slots) was read, but the slot of this stream id holds no usable stream.
    Slot { slots: usize, why: String },
}

/// CubeCL's `CUstream` for stream id `id` on `like`'s device, with the number of slots of its
/// stream pool and the slot's index: read from the CUDA server's `Debug` description
/// ([`stream_slots`]; CubeCL 0.10 has no accessor), and checked to be a stream (not the null
/// stream) of `ctx`. Runs on CubeCL's device thread, where the server call runs at once.
pub(crate) fn find_cubecl_stream(
    like: &CubeTensor<CudaRuntime>,
    id: u64,
    ctx: dsys::CUcontext,
) -> Result<(usize, usize, dsys::CUstream), FindError> {
    use cubecl_common::device::Device as _;
    type Server = <CudaRuntime as cubecl::Runtime>::Server;
    let server = cubecl_common::device_handle::DeviceHandle::<Server>::new(like.device.to_id());
    let description = server
        .submit_blocking(|server| format!("{server:?}"))
        .map_err(|_| FindError::Description("CubeCL's device thread is gone".into()))?;
    let slots = stream_slots(&description).map_err(FindError::Description)?;
    // The pool holds CubeCL's streams (`max_streams` of them) and one more for its own use.
    if slots.len() < 2 {
        return Err(FindError::Description(format!(
            "a stream pool of {} slots",
            slots.len()
        )));
    }
    let n = slots.len();
    let slot_error = |why: String| FindError::Slot { slots: n, why };
    let index = (id % (n as u64 - 1)) as usize;
    let stream = slots[index].ok_or_else(|| {
        slot_error(format!(
            "stream slot {index} of {n} is empty (no CubeCL work on it yet)"
        ))
    })? as dsys::CUstream;
    if stream.is_null() {
        // The legacy default stream, which CubeCL's non-blocking streams do not wait for.
        return Err(slot_error(format!(
            "stream slot {index} holds the null stream"
        )));
    }
    let mut owner: dsys::CUcontext = std::ptr::null_mut();
    // SAFETY: `stream` is the address CubeCL's live server prints for a stream it created and
    // keeps for its lifetime; the driver only reads its context.
    unsafe { dsys::cuStreamGetCtx(stream, &mut owner) }
        .result()
        .map_err(|e| {
            slot_error(format!(
                "cuStreamGetCtx on the stream read from CubeCL: {e:?}"
            ))
        })?;
    if owner != ctx {
        return Err(slot_error(
            "the stream read from CubeCL belongs to another context".into(),
        ));
    }
    Ok((slots.len(), index, stream))
}

/// The CUDA streams of CubeCL's stream pool, slot by slot (`None`: not created), from the CUDA
/// server's `Debug` description:
/// `... streams: StreamPool { streams: [None, Some(StreamWrapper { stream: Stream { sys: 0x..., ...`.
pub(crate) fn stream_slots(description: &str) -> Result<Vec<Option<u64>>, String> {
    const POOL: &str = "streams: StreamPool { streams: [";
    let start = description
        .find(POOL)
        .ok_or("no stream pool in CubeCL's CUDA server description")?
        + POOL.len();
    let slot = |text: &str| -> Result<Option<u64>, String> {
        let text = text.trim();
        if text == "None" {
            return Ok(None);
        }
        const SYS: &str = "sys: 0x";
        let at = text.find(SYS).ok_or("a stream slot without `sys: 0x...`")? + SYS.len();
        let hex: String = text[at..]
            .chars()
            .take_while(char::is_ascii_hexdigit)
            .collect();
        u64::from_str_radix(&hex, 16)
            .map(Some)
            .map_err(|e| format!("a stream address `{hex}`: {e}"))
    };
    let (mut slots, mut depth, mut quoted, mut escaped, mut from) =
        (Vec::new(), 0usize, false, false, start);
    for (i, c) in description[start..].char_indices() {
        let i = start + i;
        if quoted {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => quoted = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth > 0 => depth -= 1,
            ']' => {
                if !description[from..i].trim().is_empty() {
                    slots.push(slot(&description[from..i])?);
                }
                return Ok(slots);
            }
            ',' if depth == 0 => {
                slots.push(slot(&description[from..i])?);
                from = i + 1;
            }
            _ => {}
        }
    }
    Err("the stream pool's list does not end".into())
}
