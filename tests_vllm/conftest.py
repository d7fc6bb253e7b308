"""The vLLM suite's ranks exit as processes do (spawned, torchrun): vLLM's CPU engine removes its shared
memory segments at process exit, in C++, which a fork server's or the warm launcher's os._exit skips; the
next tp=2 engine then finds the segment's fixed name taken (errno 17)."""
import tidal.common.spawn
import tests.e2e

tidal.common.spawn.START_METHOD = "spawn"
tests.e2e.WARM = False
