use super::problem::{layout, Layout};

#[test]
fn layouts_of_strided_matrices() {
    // Row-major with pitched rows: ld is the row stride.
    assert_eq!(
        layout([3, 5], [8, 1], false),
        Some(Layout {
            rows: 3,
            cols: 5,
            ld: 8,
            trans: false
        })
    );
    // A transposed view of a row-major [5, 3] matrix: read the storage with the flag flipped.
    assert_eq!(
        layout([3, 5], [1, 3], false),
        Some(Layout {
            rows: 5,
            cols: 3,
            ld: 3,
            trans: true
        })
    );
    assert_eq!(
        layout([3, 5], [1, 4], true),
        Some(Layout {
            rows: 5,
            cols: 3,
            ld: 4,
            trans: false
        })
    );
    // One row or one column.
    assert_eq!(
        layout([1, 5], [0, 1], false),
        Some(Layout {
            rows: 1,
            cols: 5,
            ld: 5,
            trans: false
        })
    );
    assert_eq!(
        layout([4, 1], [2, 7], true),
        Some(Layout {
            rows: 4,
            cols: 1,
            ld: 2,
            trans: true
        })
    );
    // Broadcast rows or a non-unit inner stride need a copy.
    assert_eq!(layout([3, 5], [0, 1], false), None);
    assert_eq!(layout([3, 5], [10, 2], false), None);
}

/// The stream pool read from a description shaped as CubeCL 0.10's CUDA server prints it
/// (derived `Debug` of structs of the same names and nesting, raw pointers included), with
/// brackets, commas and quotes inside strings and nested lists around it.
#[test]
#[allow(dead_code)] // The structs are only printed.
fn stream_slots_from_a_server_description() {
    use std::collections::HashMap;
    #[derive(Debug)]
    struct Stream {
        sys: *mut u8,
        memory_management_gpu: &'static str,
        errors: Vec<String>,
    }
    #[derive(Debug)]
    struct StreamWrapper {
        stream: Stream,
        cursor: u64,
        last_synced: HashMap<usize, u64>,
    }
    #[derive(Debug)]
    struct StreamPool {
        streams: Vec<Option<StreamWrapper>>,
        max_streams: usize,
    }
    #[derive(Debug)]
    struct MultiStream {
        streams: StreamPool,
        shared_bindings_pool: Vec<(u64, u64)>,
    }
    #[derive(Debug)]
    struct CudaServer {
        ctx: Vec<Option<(i32, String)>>,
        streams: MultiStream,
    }
    let wrapper = |sys: usize, note: &'static str| {
        Some(StreamWrapper {
            stream: Stream {
                sys: sys as *mut u8,
                memory_management_gpu: note,
                errors: vec!["a ] in (an, error\" \\".into()],
            },
            cursor: 7,
            last_synced: HashMap::from([(1, 2)]),
        })
    };
    let server = CudaServer {
        ctx: vec![Some((1, "streams: [".into())), None],
        streams: MultiStream {
            streams: StreamPool {
                streams: vec![
                    None,
                    wrapper(0x7f00_dead_beef, "DynamicMemoryManagement \"a[b], {c}\""),
                    None,
                    wrapper(0x55aa_0010, ""),
                ],
                max_streams: 3,
            },
            shared_bindings_pool: vec![(1, 2)],
        },
    };
    let description = format!("{server:?}");
    assert_eq!(
        crate::cuda_stream::stream_slots(&description),
        Ok(vec![None, Some(0x7f00_dead_beef), None, Some(0x55aa_0010)]),
        "{description}"
    );
    assert!(crate::cuda_stream::stream_slots("CudaServer { ctx: [] }").is_err());
    assert!(
        crate::cuda_stream::stream_slots("streams: StreamPool { streams: [None, Some(").is_err()
    );
}
