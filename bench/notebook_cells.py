"""Run chosen code cells of a notebook as a plain script (its parameters cell first, then overrides), printing each
cell's wall time, with every thread's Python stack dumped every DUMP_S seconds while a cell runs (a stall shows
where it waits). Diagnosis only.
    python -X faulthandler bench/notebook_cells.py NOTEBOOK CELLS OVERRIDES_JSON
"""
import faulthandler
import json
import sys
import time
nb_path, cells, overrides = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], json.loads(sys.argv[3])
nb_cells = json.load(open(nb_path))["cells"]
ns = {"__name__": "__main__"}
exec("".join(nb_cells[1]["source"]), ns)  # the parameters cell
ns.update(overrides)
for i in cells:
    src = "".join(nb_cells[i]["source"])
    t0 = time.perf_counter()
    print(f"=== cell {i} start {time.strftime('%H:%M:%S')}", flush=True)
    faulthandler.dump_traceback_later(int(overrides.get("DUMP_S", 40)), repeat=True, file=sys.stdout)
    exec(compile(src, f"{nb_path}#cell{i}", "exec"), ns)
    faulthandler.cancel_dump_traceback_later()
    print(f"=== cell {i} done in {time.perf_counter() - t0:.1f} s", flush=True)
