"""A stand-in for the vendor SDK, written by the tests that need one: `exec/qaic-compile`,
`exec/qaic-qpc` and a `versions/apps.xml`, following the vendor's documented CLI.

qaic-compile: single-dash `-flag=value` or bare booleans; `-m=<model>` is required and must
exist; `-aic-binary-dir=<dir>` receives `programqpc.bin`; an unknown flag is fatal ("Invalid
option -x. Use -h ...", exit 1). What it writes is not a compiled program: the bytes are a
digest of the model and the flags, so different flags give different QPCs. It prints perf
metrics when `-aic-perf-metrics` is given and a warning when `-aic-perf-warnings` is, and
records its argv, working folder and pid in `<sdk>/calls.jsonl` for the tests to read.
`<status>` in the SDK folder's `fail` file makes it print an error and exit so; `<seconds>`
in `sleep` makes it wait that long first (a compile that outruns a time limit); `<bytes>` in
`allocate` makes it map that much memory first (a compile that needs more than a memory
limit: the allocation fails, it prints the error and exits 1).

qaic-qpc: `validate -i <file>` exits 0 when the file starts with the stand-in's magic.
qaic-runner: `-t <qpc folder> -d <device> -n <iterations> --aic-profiling-type stats|trace
--aic-profiling-out-dir <dir>` needs `<folder>/programqpc.bin`, writes raw stats files there
and prints the inference rate. qaic-opstats: `--qpc <file> --input-dir <raw> --output-dir
<dir> --summary --trace` needs the raw files and writes a summary (text, CSV) and a trace.
"""

from __future__ import annotations

import sys
from pathlib import Path

VERSION = "1.18.2.0"
MAGIC = b"STANDIN-QPC\n"

KNOWN = {
    "m", "model", "aic-binary-dir", "aic-hw", "aic-hw-version", "aic-num-cores", "ols", "mos",
    "batchsize", "onnx-define-symbol", "convert-to-fp16", "mxfp6-matmul", "retained-state",
    "aic-perf-metrics", "aic-perf-warnings", "stats-level", "network-specialization-config",
    "custom-IO-list-file", "multicast-weights", "aic-enable-depth-first", "time-passes",
}  # fmt: skip

COMPILE = """#!{python}
import hashlib, json, mmap, os, sys, time
from pathlib import Path
sdk = Path(__file__).resolve().parent.parent
known = {known!r}
flags = {{}}
for arg in sys.argv[1:]:
    if not arg.startswith("-"):
        print(f"Unexpected argument {{arg}}", file=sys.stderr); sys.exit(1)
    name, _, value = arg[1:].partition("=")
    if name not in known:
        print(f"Invalid option -{{name}}. Use -h for help.", file=sys.stderr); sys.exit(1)
    flags.setdefault(name, []).append(value)
with open(sdk / "calls.jsonl", "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid()}}) + "\\n")
if (sdk / "sleep").exists():
    time.sleep(float((sdk / "sleep").read_text()))
if (sdk / "allocate").exists():
    mmap.mmap(-1, int((sdk / "allocate").read_text()))
fail = sdk / "fail"
if fail.exists():
    print("ERROR: Graph could not be compiled: unsupported operator Foo", file=sys.stderr)
    sys.exit(int(fail.read_text()))
model = (flags.get("m") or flags.get("model") or [""])[0]
out = (flags.get("aic-binary-dir") or [""])[0]
if not model or not Path(model).is_file() or not out:
    print("-m=<model> and -aic-binary-dir=<dir> are required", file=sys.stderr); sys.exit(2)
digest = hashlib.sha256(Path(model).read_bytes() + json.dumps(sorted(flags.items())).encode())
Path(out).mkdir(parents=True)
(Path(out) / "programqpc.bin").write_bytes({magic!r} + digest.digest())
print("Compiling model ...")
if "aic-perf-metrics" in flags:
    print("Original MAC estimate: 1234567")
    print("AIC HMX MAC estimate: 1200000")
    print("VTCMMaxSize: 8323072")
    print("StaticSharedDDRSize: 65536")
if "aic-perf-warnings" in flags:
    print("Warning: 2 operators execute on HVX; consider -convert-to-fp16")
print("Compilation done.")
"""

QPC = """#!{python}
import sys
args = sys.argv[1:]
if len(args) != 3 or args[0] != "validate" or args[1] != "-i":
    print("usage: qaic-qpc validate -i <programqpc.bin>", file=sys.stderr); sys.exit(2)
data = open(args[2], "rb").read()
if data.startswith({magic!r}):
    print("QPC is valid. Number of NSPs required: 4"); sys.exit(0)
print("ERROR: invalid QPC magic", file=sys.stderr); sys.exit(1)
"""

RUNNER = """#!{python}
import sys
from pathlib import Path
args = sys.argv[1:]
opts = {{}}
it = iter(args)
for a in it:
    opts.setdefault(a, []).append(next(it, ""))
qpc = Path(opts.get("-t", [""])[0]) / "programqpc.bin"
if not qpc.is_file() or "-d" not in opts or "-n" not in opts:
    print("usage: qaic-runner -t <qpc dir> -d <device> -n <n>", file=sys.stderr); sys.exit(2)
out = Path(opts["--aic-profiling-out-dir"][0])
out.mkdir(parents=True)
n = int(opts["-n"][0])
for i in range(n):
    (out / f"aic-profiling-program-0-inf-{{i}}.bin").write_bytes(b"raw")
print(f"Total inferences: {{n}}")
print("Inf/Sec: 1234.5")
"""

OPSTATS = """#!{python}
import json, sys
from pathlib import Path
args = sys.argv[1:]
raw = Path(args[args.index("--input-dir") + 1])
out = Path(args[args.index("--output-dir") + 1])
if not any(raw.iterdir()):
    print("no raw stats", file=sys.stderr); sys.exit(1)
out.mkdir(parents=True)
(out / "opstats-summary.txt").write_text("Conv 120 pcycles\\n")
(out / "opstats-summary.csv").write_text("op,pcycles\\nConv,120\\n")
(out / "trace.json").write_text(json.dumps({{"traceEvents": []}}))
print("opstats done")
"""


def write_sdk(root: Path) -> Path:
    """The stand-in SDK under `root` (returned)."""
    exec_dir = root / "exec"
    exec_dir.mkdir(parents=True)
    tools = (("qaic-compile", COMPILE), ("qaic-qpc", QPC), ("qaic-runner", RUNNER),
             ("qaic-opstats", OPSTATS))  # fmt: skip
    for name, text in tools:
        path = exec_dir / name
        path.write_text(text.format(python=sys.executable, known=sorted(KNOWN), magic=MAGIC))
        path.chmod(0o755)
    (root / "versions").mkdir()
    (root / "versions" / "apps.xml").write_text(f"<apps><version>{VERSION}</version></apps>\n")
    return root


def calls(root: Path) -> list[dict[str, object]]:
    import json

    path = root / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]
