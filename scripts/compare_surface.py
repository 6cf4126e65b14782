#!/usr/bin/env python3
"""Prints the Python surface of `mooncake.store` and `tycho.store` side by side (every public
method of the store class, every public module name) and `tycho master`'s handling of every
`mooncake_master` flag; exits non-zero on any difference or missing name.

    scripts/compare_surface.py --mooncake-python M/bin/python --tycho-python T/bin/python \\
        --mooncake-master M/bin/mooncake_master --tycho-bin target/debug/tycho

Each interpreter is asked for its own surface (`--dump`), so the two packages never share a
process. Compared per method: parameter names in order, which have defaults, and default values
where Mooncake's is a plain literal (Tycho's additions listed in `ADDED`, at the end and with
defaults, are shown and set aside) (its `ReplicateConfig` default object counts the same as
Tycho's `None`). Also compared: `ReplicateConfig()` field defaults and `SoftPinAction` values.
"""

import argparse
import json
import queue
import re
import subprocess
import sys
import threading
import time

# Differences kept on purpose, with why; printed, not counted.
DELIBERATE = {
    "load_tensor_from_safetensor": "Mooncake's required file_name follows a parameter with a default, which a "
                                   "Python signature cannot express; Tycho's defaults to None and raises "
                                   "TypeError when it is not given",
}
# Parameters Tycho adds after all of Mooncake's, each with a default (so every Mooncake call
# stays valid), by method.
ADDED = {
    "allocate_and_mount_segment": {"stable_id"},
    "mount_segment": {"stable_id"},
}
CONFIG_FIELDS = [
    "replica_num", "soft_pin_action", "soft_pin_ttl_ms", "with_hard_pin", "preferred_segment",
    "preferred_segments", "prefer_alloc_in_same_node", "group_ids",
]
CONFIG_DEFAULT = "<ReplicateConfig default>"


def _split_top(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[(<{":
            depth += 1
        elif ch in "])>}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _pybind_params(name, doc):
    """Parameters of the first overload in a pybind11 docstring."""
    for line in (doc or "").splitlines():
        line = re.sub(r"^\d+\.\s*", "", line.strip())
        if line.startswith(name + "(") and "self" in line:
            inner = line[len(name) + 1: line.rindex(")")]
            params = []
            for p in _split_top(inner):
                pname, _, default = p.partition("=")
                pname = pname.split(":")[0].strip()
                if pname == "self":
                    continue
                d = default.strip()
                if not d:
                    params.append([pname, False, None])
                elif "ReplicateConfig object" in d:
                    params.append([pname, True, CONFIG_DEFAULT])
                else:
                    params.append([pname, True, d])
            return params
    return None


def _inspect_params(fn):
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = []
    for p in sig.parameters.values():
        if p.name in ("self", "$self"):
            continue
        name = "*" + p.name if p.kind == p.VAR_POSITIONAL else p.name
        if p.default is p.empty:
            params.append([name, False, None])
        elif p.name == "config" and p.default is None:
            params.append([name, True, CONFIG_DEFAULT])
        else:
            params.append([name, True, repr(p.default)])
    return params


def dump(impl):
    if impl == "mooncake":
        import mooncake.store as m
    else:
        import tycho.store as m
    cls = m.MooncakeDistributedStore
    methods = {}
    for name in sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))):
        fn = getattr(cls, name)
        if impl == "mooncake":
            methods[name] = _pybind_params(name, fn.__doc__)
        elif name == "setup":
            # Tycho's setup parses *args / **kwargs itself, in this order.
            methods[name] = [[n, False, None] for n in m._SETUP_ORDER]
        else:
            methods[name] = _inspect_params(fn)
    if impl == "mooncake":
        # Only the names of setup's positional form are compared.
        methods["setup"] = [[p[0], False, None] for p in methods["setup"]]
    c = m.ReplicateConfig()
    fields = {}
    for f in CONFIG_FIELDS:
        v = getattr(c, f, "<missing>")
        fields[f] = repr(list(v)) if isinstance(v, (list, tuple)) else (str(v).split(".")[-1] if f == "soft_pin_action" else repr(v))
    actions = {n: int(getattr(m.SoftPinAction, n)) for n in ("PRESERVE", "ENABLE", "DISABLE")}
    names = sorted(n for n in dir(m) if not n.startswith("_"))
    print(json.dumps({"methods": methods, "config": fields, "soft_pin_action": actions, "names": names}))


def _normalise(params):
    """pybind11 names unnamed parameters arg0, arg1: only their position counts."""
    if params is None:
        return None
    out = []
    for name, has_default, default in params:
        if re.fullmatch(r"\*?arg\d+", name):
            name = "<positional>"
        if default is not None:
            default = default.replace('"', "'")
        out.append((name, has_default, default))
    return out


def _fmt(params):
    if params is None:
        return "(missing)"
    return "(" + ", ".join(n + (f"={d}" if h else "") for n, h, d in params) + ")"


def _start_tycho(tycho_bin, flags):
    proc = subprocess.Popen([tycho_bin, "master", "--rpc-address", "127.0.0.1", "--rpc-port", "0",
                             "--metrics-address", "127.0.0.1", "--metrics-port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout] + [lines.put(None)], daemon=True).start()
    deadline = time.monotonic() + 30
    ok = False
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith("tycho master listening on "):
            ok = True
            break
    proc.kill()
    _, err = proc.communicate()
    return ok, err


def compare_flags(mooncake_master, tycho_bin):
    """Starts `tycho master` with every `mooncake_master` flag at Mooncake's default value."""
    text = subprocess.run([mooncake_master, "--help"], capture_output=True, text=True).stderr
    text += subprocess.run([mooncake_master, "--help"], capture_output=True, text=True).stdout
    flags = []
    for m in re.finditer(r"^    -(\w+) \((.*?)\)\s+type: (\w+)\s+default: (\"[^\"]*\"|\S+)", text, re.M | re.S):
        name, typ, default = m.group(1), m.group(3), m.group(4).strip('"')
        flags.append((name, typ, default))
    names = sorted({f[0] for f in flags})
    skip = {"help", "helpfull", "helpshort", "helppackage", "helpxml", "helpon", "helpmatch", "version"}
    # The lease and TTL flags also take duration strings; use them for a few.
    durations = {"default_kv_lease_ttl": "10s", "default_kv_soft_pin_ttl": "30m", "max_kv_soft_pin_ttl": "24h"}
    args = []
    for name, _, default in flags:
        if name in skip or name in ("rpc_port", "port", "metrics_port", "rpc_address", "metrics_host"):
            continue
        args.append(f"--{name}={durations.get(name, default)}")
    ok, err = _start_tycho(tycho_bin, args)
    print(f"\nmooncake_master flags: {len(names)} listed; tycho master started with {len(args)} of them "
          f"at Mooncake's defaults (the rest pick ports and print help): {'ok' if ok else 'FAILED'}")
    if not ok:
        print(err[-2000:])
    refused_ok = True
    # (--enable_ha is accepted: HA is on with --etcd_endpoints, and refused without them.)
    for flag in ("--enable_oplog=true", "--enable_snapshot=true", "--enable_snapshot_restore=true"):
        r = subprocess.run([tycho_bin, "master", "--rpc-port", "0", flag], capture_output=True, text=True, timeout=30)
        good = r.returncode != 0 and "not supported" in r.stderr
        refused_ok &= good
        print(f"  {flag:<34} {'refused' if good else 'NOT REFUSED'}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
    return ok and refused_ok and len(names) == 134


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", choices=["mooncake", "tycho"])
    ap.add_argument("--mooncake-python")
    ap.add_argument("--tycho-python")
    ap.add_argument("--mooncake-master")
    ap.add_argument("--tycho-bin")
    a = ap.parse_args()
    if a.dump:
        dump(a.dump)
        return 0
    if not (a.mooncake_python and a.tycho_python):
        ap.error("give --mooncake-python and --tycho-python (or --dump IMPL)")
    got = {}
    for impl, py in (("mooncake", a.mooncake_python), ("tycho", a.tycho_python)):
        out = subprocess.run([py, __file__, "--dump", impl], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"cannot read the {impl} surface:\n{out.stderr}")
            return 2
        got[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    diffs = 0
    print(f"{'method':<42} {'same':<5} mooncake / tycho")
    for name in sorted(got["mooncake"]["methods"]):
        mc = _normalise(got["mooncake"]["methods"][name])
        ty = _normalise(got["tycho"]["methods"].get(name))
        added = []
        if mc is not None and ty is not None and name in ADDED:
            # Tycho's keyword-only additions at the end, with defaults: every Mooncake call
            # stays valid. Only those listed in ADDED; compared without them.
            added = [t for t in ty[len(mc):] if t[0] in ADDED[name] and t[1]]
            if len(mc) + len(added) == len(ty):
                ty = ty[: len(mc)]
        if mc is not None and ty is not None and len(mc) == len(ty):
            # Mooncake's unnamed parameters take any name in Tycho (Tycho's accept keywords too).
            ty = [(m[0], t[1], t[2]) if m[0] == "<positional>" else t for m, t in zip(mc, ty)]
        same = mc == ty and name in got["tycho"]["methods"]
        deliberate = not same and name in got["tycho"]["methods"] and name in DELIBERATE
        diffs += not same and not deliberate
        print(f"{name:<42} {'yes' if same else 'note' if deliberate else 'NO':<5} {_fmt(mc)}")
        if same and added:
            print(f"{'':<48} Tycho adds, with defaults: {', '.join(f'{a[0]}={a[2]}' for a in added)}")
        if not same:
            print(f"{'':<48} {_fmt(ty) if name in got['tycho']['methods'] else '(missing)'}")
            if deliberate:
                print(f"{'':<48} deliberate: {DELIBERATE[name]}")
    missing = sorted(set(got["mooncake"]["names"]) - set(got["tycho"]["names"]))
    diffs += len(missing)
    print(f"\nmodule names: {len(got['mooncake']['names'])} in mooncake.store; missing from tycho.store: "
          f"{', '.join(missing) if missing else 'none'}")
    print(f"\n{'ReplicateConfig() field':<36} {'same':<5} mooncake / tycho")
    for f in CONFIG_FIELDS:
        mc, ty = got["mooncake"]["config"][f], got["tycho"]["config"][f]
        diffs += mc != ty
        print(f"{f:<36} {'yes' if mc == ty else 'NO':<5} {mc}" + ("" if mc == ty else f" / {ty}"))
    mc, ty = got["mooncake"]["soft_pin_action"], got["tycho"]["soft_pin_action"]
    diffs += mc != ty
    print(f"{'SoftPinAction values':<36} {'yes' if mc == ty else 'NO':<5} {mc}" + ("" if mc == ty else f" / {ty}"))
    flags_ok = True
    if a.mooncake_master and a.tycho_bin:
        flags_ok = compare_flags(a.mooncake_master, a.tycho_bin)
    print(f"\n{diffs} difference(s) in the Python surface; master flags {'ok' if flags_ok else 'FAILED'}")
    return 1 if diffs or not flags_ok else 0


if __name__ == "__main__":
    sys.exit(main())
