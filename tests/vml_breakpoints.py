"""gdb script (``gdb -batch --readnever -x tests/vml_breakpoints.py --args python PROGRAM``):
print a line ``VML <entry point> <gdb thread number>`` for each call the program makes into
oneMKL's vector math (``vms*``/``vmd*``, the functions torch's CPU kernels call), on gdb's
stdout. The program stops itself with SIGTRAP once torch is imported (libtorch_cpu loaded): the
breakpoints are set there, by symbol name (``--readnever``: no debug info is read, which oneMKL
has none of)."""

import gdb

gdb.execute("set pagination off")
gdb.execute("set confirm off")
gdb.execute("run", to_string=True)  # until the program's SIGTRAP
gdb.execute("rbreak ^vm[sd][A-Z][A-Za-z0-9]*$", to_string=True)
while True:
    try:
        gdb.execute("continue", to_string=True)
        name = gdb.selected_frame().name()
    except gdb.error:  # the program has exited
        break
    gdb.write(f"VML {name.split('@')[0]} {gdb.selected_thread().num}\n")
    gdb.flush()
