#!/usr/bin/env python3
"""Writes tests/data/parquet: small Parquet files from pyarrow (the writer behind the datasets on
the Hugging Face Hub) for the Parquet reader's tests (tests/parquet.rs), and expected.json.

    python3 tools/peers/parquet_fixtures.py tests/data/parquet
"""
import json, os, sys
import pyarrow as pa, pyarrow.parquet as pq
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
print("pyarrow", pa.__version__)
texts = []
for i in range(300):
    if i % 37 == 5:
        texts.append(None)
    elif i % 11 == 0:
        texts.append("")
    else:
        texts.append(("Row %d: " % i) + "héllo wörld ✓ " * (i % 7) + ("repeat" if i % 3 == 0 else "unique %d" % (i * 7919)))
table = pa.table({"id": pa.array(range(300), pa.int64()), "text": pa.array(texts, pa.string())})
json.dump(texts, open(os.path.join(out, "expected.json"), "w"), ensure_ascii=False)
cases = []
for codec in ["NONE", "SNAPPY", "GZIP", "ZSTD"]:
    for dictionary in [True, False]:
        for version in ["1.0", "2.0"]:
            name = f"{codec.lower()}_{'dict' if dictionary else 'plain'}_v{version[0]}.parquet"
            pq.write_table(table, os.path.join(out, name), compression=codec, use_dictionary=dictionary,
                           data_page_version=version, row_group_size=120, data_page_size=512)
            cases.append(name)
print(len(cases), "files,", sum(os.path.getsize(os.path.join(out, c)) for c in cases), "bytes")
