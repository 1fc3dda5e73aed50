"""Builds variants of a harness host file with nvcc side by side, for harness.py and backward.py:
each a shared library for sm_90a with its own -D macros, with ptxas's register and spill report
(and its first warnings) printed for the kernel `entry`."""
import re
import subprocess


def build_variants(nvcc, host, entry, jobs, extra=()):
    """`jobs`: {label: (library path, [-D flags])}. Returns whether every variant built."""
    procs = {}
    for label, (lib, defines) in jobs.items():
        cmd = [nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler",
               "-fPIC", *defines, *extra, "-Xptxas", "-v", host, "-o", lib, "-lcuda"]
        procs[label] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ok = True
    for label, p in procs.items():
        log = p.communicate()[0]
        if p.returncode != 0:
            ok = False
            print(f"build {label} failed:\n{log[-6000:]}")
            continue
        # ptxas reports each kernel's function, then its registers and spills.
        m = re.search(entry + r".*?\n(?:.*\n)*?.*?Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        for x in [x for x in log.splitlines() if "warning" in x.lower()][:6]:
            print("  " + x)
        print(f"built {label}: {m.group(1) if m else '?'} registers, "
              f"spill stores {max(map(int, spills)) if spills else 0} bytes")
    return ok
