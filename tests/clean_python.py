"""`python -c SCRIPT ARGS...` without the interpreter's start: a server process imports torch, transformers and the
transformers modules that model code imports, once (never hf_deep_nmt), and forks a child per script, which runs it as
a fresh interpreter would, in its own working folder, environment, module cache and output files.
`hf-deep-nmt upgrade-code` checks each folder in two clean processes; forked from here, each check skips the 5 CPU
seconds a fresh interpreter spends importing.

What differs from a fresh interpreter, and why it does not matter to the scripts run here: the imported modules are
the server's (torch and transformers, imported before the child's environment was set, so the child's
`HF_MODULES_CACHE` is given to transformers' module loader by hand; `HF_HOME` and `HF_HUB_OFFLINE` are the test
session's in both), and `sys.path` is the server's (a fresh interpreter's; a child never sees tests/ or the package
unless it is installed)."""

import json
import os
import subprocess
import sys

SERVER = r"""
import gc, json, os, sys, traceback

import torch  # noqa: F401
import transformers
import transformers.dynamic_module_utils
import transformers.utils.hub
# what the model code of every release imports from transformers (the activations module alone pulls in
# torch.distributed.tensor: 1.5 CPU s), and what loading and generating with it imports
import transformers.activations
import transformers.cache_utils
import transformers.configuration_utils
import transformers.generation
import transformers.initialization
import transformers.modeling_layers
import transformers.modeling_outputs
import transformers.modeling_utils
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, GenerationMixin, PreTrainedConfig  # noqa: F401

assert "hf_deep_nmt" not in sys.modules, "the clean server imported hf_deep_nmt"
# the imports' objects out of the garbage collector's sight in every child: a full collection there would walk them
# all (0.2 CPU s) and copy their pages into the child
gc.freeze()


def child(request):
    for stream, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        descriptor = os.open(path, os.O_RDONLY if stream == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(descriptor, stream)
        os.close(descriptor)
    sys.stdin, sys.stdout, sys.stderr = (
        open(0, closefd=False), open(1, "w", closefd=False), open(2, "w", closefd=False)
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    modules = request["env"].get("HF_MODULES_CACHE", transformers.utils.hub.HF_MODULES_CACHE)
    for module in (transformers.utils.hub, transformers.utils, transformers.dynamic_module_utils):
        module.HF_MODULES_CACHE = modules
    sys.argv = ["-c", *request["args"]]
    code = 0
    try:
        exec(compile(request["source"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


class CleanPython:
    """A started server; `run` stands in for `subprocess.run([sys.executable, "-c", SCRIPT, *ARGS], ...)`."""

    def __init__(self, folder):
        self.folder = folder
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=folder,
        )
        assert self.server.stdout.readline() == "ready\n", "the clean server did not start"
        self.count = 0

    def run(self, command, *, cwd, env, capture_output=True, text=True, stdin=None, **ignored):
        assert command[0] == sys.executable and command[1] == "-c" and capture_output and text, command
        self.count += 1
        outputs = {name: self.folder / f"{self.count}.{name}" for name in ("stdout", "stderr")}
        request = dict(source=command[2], args=list(command[3:]), cwd=str(cwd), env=dict(env))
        request.update((name, str(path)) for name, path in outputs.items())
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        returncode = json.loads(self.server.stdout.readline())
        stdout, stderr = (outputs[name].read_text() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=60)
