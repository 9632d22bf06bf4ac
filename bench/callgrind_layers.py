#!/usr/bin/env python3
"""Instructions (Ir) of a callgrind run by coverbs layer and by thread role.

    callgrind_layers.py [--json OUT] callgrind.out.PID-01 callgrind.out.PID-02 ...

Reads the per-thread files of `valgrind --tool=callgrind --separate-threads=yes`
and prints, for each thread, its role and its self (exclusive) Ir summed by
layer. Used by callgrind_cost.sh, which runs it on two runs of different
lengths and divides the difference by the difference in operations.

Attribution of one function's self cost (every instruction it executes,
including code the compiler inlined into it from other headers):
  - by the source file of the function (callgrind's fl=): a workspace path
    (Bazel's /proc/self/cwd/...) under transport/soft/, transport/verbs/,
    transport/loop/, core/, transport/, cm/, rpc/, bench/ or examples/ names
    the layer (the providers are not the framework);
  - a function from a system header compiled into the binary (a std:: or
    absl:: template instantiated by coverbs, e.g. std::vector<coverbs::cm::X>
    or an absl::AnyInvocable invoker of a coverbs lambda) is attributed to
    the layer whose namespace its name mentions first, in a separate
    "(templates)" row of that layer;
  - anything else by its object: libc, libstdc++, libabsl, liburing, ld.so,
    valgrind's preload, or "other".
A thread's role comes from the functions it ran: the soft provider's
progress engine (coverbs::transport::soft::Engine::Loop), the bench server
(coverbs::bench::Server / Serve*), the bench client (coverbs::bench::Drive*);
the thread that ran main() is "main", anything else "other".
"""
import collections
import json
import re
import sys

LAYER_PATHS = [
    ("transport/soft", "transport/soft/"),
    ("transport/verbs", "transport/verbs/"),
    ("transport/loop", "transport/loop/"),
    ("core", "core/"),
    ("transport", "transport/"),
    ("cm", "cm/"),
    ("rpc", "rpc/"),
    ("bench", "bench/"),
    ("examples", "examples/"),
]
NAMESPACES = [
    ("transport/soft", "coverbs::transport::soft::"),
    ("transport/verbs", "coverbs::transport::verbs::"),
    ("transport/loop", "coverbs::transport::loop::"),
    ("transport", "coverbs::transport::"),
    ("cm", "coverbs::cm::"),
    ("rpc", "coverbs::rpc::"),
    ("bench", "coverbs::bench::"),
    ("examples", "coverbs::examples::"),
    ("core", "coverbs::"),  # core's types live in namespace coverbs itself
]
OBJECTS = [
    ("libc", re.compile(r"/libc[.-]|/libm[.-]|/libpthread|/librt")),
    ("libstdc++", re.compile(r"/libstdc\+\+|/libgcc_s")),
    ("libabsl", re.compile(r"/libabsl_")),
    ("liburing", re.compile(r"/liburing")),
    ("ld.so", re.compile(r"/ld-linux")),
    ("valgrind", re.compile(r"vgpreload|valgrind")),
]
# The framework's own code: what issue 13 asks to cut.
FRAMEWORK = ("core", "transport", "cm", "rpc")


def layer_of(obj, fl, fn, binary_objs):
    # Bazel compiles with the workspace as /proc/self/cwd; system headers
    # keep absolute paths (so /usr/include/boost/core/ is not core/).
    rel = fl[len("/proc/self/cwd/"):] if fl.startswith("/proc/self/cwd/") else fl
    if rel.startswith("./"):
        rel = rel[2:]
    for name, part in LAYER_PATHS:
        if rel.startswith(part):
            return name
    if obj in binary_objs or not obj:
        # Earliest mention of a coverbs namespace in the name.
        best = None
        for name, ns in NAMESPACES:
            at = fn.find(ns)
            if at >= 0 and (best is None or at < best[0] or
                            (at == best[0] and len(ns) > best[2])):
                best = (at, name, len(ns))
        if best:
            return best[1] + " (templates)"
        return "binary: std/absl/other"
    for name, pat in OBJECTS:
        if pat.search(obj):
            return name
    return "other: " + obj.rsplit("/", 1)[-1]


def parse(path):
    """Self Ir per (object, file, function) of one callgrind output file."""
    names = {"ob": {}, "fl": {}, "fn": {}}
    cost = collections.Counter()
    events = None
    ob = fl = fn = ""
    skip_next_cost = False
    cur_ob = cur_fl = ""

    def name(kind, rest):
        m = re.match(r"\((\d+)\)(?: (.*))?$", rest)
        if not m:
            return rest
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
            return m.group(2)
        return names[kind][m.group(1)]

    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                if skip_next_cost:
                    skip_next_cost = False  # inclusive cost of a call
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    cost[(cur_ob, cur_fl, fn)] += int(parts[1])
                continue
            if line.startswith("events:"):
                events = line.split()[1:]
                if events[0] != "Ir":
                    raise SystemExit(f"{path}: first event is {events[0]}, not Ir")
            elif line.startswith("ob="):
                ob = name("ob", line[3:])
            elif line.startswith("fl="):
                fl = name("fl", line[3:])
            elif line.startswith(("fi=", "fe=")):
                # Inlined code: stays with the function it was inlined into.
                name("fl", line[3:])
            elif line.startswith("fn="):
                fn = name("fn", line[3:])
                cur_ob, cur_fl = ob, fl
            elif line.startswith(("cob=", "cfi=", "cfl=")):
                name("ob" if line.startswith("cob=") else "fl", line[4:])
            elif line.startswith("cfn="):
                name("fn", line[4:])
            elif line.startswith("calls="):
                skip_next_cost = True
    return cost


def role_of(cost):
    if any(k[2] == "main" for k in cost):
        return "main"  # waits for the reactors; sets up and tears down
    fns = " ".join(k[2] for k in cost)
    if "coverbs::transport::soft::Engine::Loop" in fns:
        return "provider"
    if re.search(r"coverbs::bench::Drive|coverbs::bench::\(anonymous namespace\)::Drive", fns):
        return "client"
    if re.search(r"coverbs::bench::Server::|coverbs::bench::Serve", fns):
        return "server"
    return "other"


def summarize(paths):
    """{role: {layer: Ir}} over all threads (a role may have several)."""
    out = collections.defaultdict(collections.Counter)
    threads = []
    for p in paths:
        cost = parse(p)
        binary_objs = {k[0] for k in cost if "coverbs_bench" in k[0] or "_bench" in k[0]}
        role = role_of(cost)
        total = 0
        for (ob, fl, fn), ir in cost.items():
            out[role][layer_of(ob, fl, fn, binary_objs)] += ir
            total += ir
        threads.append({"file": p, "role": role, "ir": total})
    return out, threads


def main(argv):
    js = None
    if len(argv) > 2 and argv[1] == "--json":
        js = argv[2]
        argv = argv[2:]
    paths = argv[1:]
    if not paths:
        raise SystemExit(__doc__)
    out, threads = summarize(paths)
    for t in threads:
        print(f"# thread {t['file']}: {t['role']}, {t['ir']:,} Ir")
    for role in sorted(out):
        for layer, ir in sorted(out[role].items(), key=lambda kv: -kv[1]):
            print(f"{role}\t{layer}\t{ir}")
    if js:
        with open(js, "w") as f:
            json.dump({"threads": threads, "ir": {r: dict(c) for r, c in out.items()}}, f,
                      indent=1)


if __name__ == "__main__":
    main(sys.argv)
