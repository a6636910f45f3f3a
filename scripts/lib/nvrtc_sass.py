"""Compiles one of our .cu sources as kernels/src/cuda/nvrtc.rs does (prelude first, sm_90a by default,
--std=c++17 --fmad=true, the pip CUDA headers), with ptxas's verbose report, and disassembles the CUBIN:
the registers, spills and ptxas warnings of each kernel, and (for kernels named on the command line)
the order of the instructions that matter to a pipelined attention loop. No GPU is needed.

Usage (scripts/kernel-sass.sh sets up the venv): nvrtc_sass.py SOURCE.cu [--arch sm_90a]
[--kernel NAME ...] [--sass-out FILE]
"""

import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The instructions whose order shows a pipelined loop's schedule: the GEMMs (HGMMA bf16, QGMMA
# e4m3), their fences and waits, barriers, the exponentials and conversions, the shuffles.
MARKS = ["QGMMA", "HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "MUFU.EX2", "BAR.SYNC", "BAR.ARV",
         "STS", "SYNCS", "BRA", "F2FP", "LDG", "SHFL", "FMNMX", "VOTE", "EXIT", "LDL", "STL"]


def compile_cubin(nvrtc, source, arch, include):
    prelude = open(os.path.join(REPO, "kernels/src/cuda/prelude.cuh")).read()
    name = os.path.splitext(os.path.basename(source))[0]
    text = f'{prelude}\n#line 1 "{name}.cu"\n{open(source).read()}'.encode()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text, f"{name}.cu".encode(), 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    # kernels/src/cuda/nvrtc.rs `options`, by hand: change both together.
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "--fmad=true", f"--include-path={include}",
            "--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.value.decode()
    if rc:
        sys.exit(f"compile failed ({rc}):\n{log}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return log, cubin.raw


def report(log):
    """One line per kernel: registers, spills, stack; then every ptxas warning or remark."""
    kernel = None
    rows = {}
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
            rows[kernel] = {}
        elif kernel and "spill stores" in line:
            rows[kernel]["spills"] = re.sub(r"^.*?\.\s+", "", line).strip()
        elif kernel and "Used" in line and "registers" in line:
            rows[kernel]["regs"] = re.search(r"Used (\d+) registers", line).group(1)
        elif line.strip() and ("Performance Loss" in line or not line.startswith("ptxas")):
            # A warning: the compiler's, or ptxas's serialised wgmma, which it reports as a warning
            # (C7512: too few registers) or as mere info (C7515: a non-wgmma write to an accumulator
            # while its wgmma may be in flight).
            print(line)
    for k, r in sorted(rows.items()):
        print(f"{k}\tregs {r.get('regs', '?')}\t{r.get('spills', '?')}")


def sequence(sass, kernel):
    """The marked instructions of `kernel` in program order, runs of one collapsed (MUFU.EX2x16)."""
    lines = sass.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith(f".text.{kernel}:"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(".text.")), len(lines))
    out, last, count = [], None, 0
    for line in lines[start:end]:
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        key = next((k for k in MARKS if k in m.group(2)), None)
        if key is None:
            continue
        if key in ("BRA", "EXIT", "WARPGROUP.DEPBAR", "BAR.SYNC", "BAR.ARV", "STS", "SYNCS", "LDL", "STL"):
            key += f"({m.group(1)}:{m.group(2).split()[-1][:24]})"
        if key == last:
            count += 1
            continue
        if last:
            out.append(f"{last}x{count}" if count > 1 else last)
        last, count = key, 1
    if last:
        out.append(f"{last}x{count}" if count > 1 else last)
    return " ".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--kernel", action="append", default=[])
    ap.add_argument("--sass-out")
    args = ap.parse_args()
    cu13 = glob.glob(os.path.join(sys.prefix, "lib/python3*/site-packages/nvidia/cu13"))[0]
    lib = next(l for l in glob.glob(os.path.join(cu13, "lib/libnvrtc.so*")) if "builtins" not in l)
    nvrtc = ctypes.CDLL(lib)
    log, cubin = compile_cubin(nvrtc, args.source, args.arch, os.path.join(cu13, "include"))
    report(log)
    if not args.kernel and not args.sass_out:
        return
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"nvrtc-sass-{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(cu13, "bin/nvdisasm"), "-c", path], check=True,
                          capture_output=True, text=True).stdout
    os.unlink(path)
    if args.sass_out:
        with open(args.sass_out, "w") as f:
            f.write(sass)
    for k in args.kernel:
        print(f"\n== {k}\n{sequence(sass, k)}")


if __name__ == "__main__":
    main()
