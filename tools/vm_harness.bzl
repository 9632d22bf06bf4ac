"""Detects whether the VM harness (tests/vm) can run on this machine.

Generates @vm_harness//:defs.bzl with VM_AVAILABLE and VM_REASON. The VM test
targets use them for target_compatible_with, so that `bazel test //...` runs
them where the harness works and reports them as SKIPPED (with the reason
printed) where it does not, instead of passing them.

The check is re-evaluated when Bazel's server starts; after running
tests/vm/setup.sh in a live workspace, `bazel sync --configure` (or `bazel
shutdown`) picks it up.
"""

def _vm_harness_impl(rctx):
    check = rctx.path(Label("@//tests/vm:run-in-vm.sh"))
    res = rctx.execute(["bash", str(check), "--check"], timeout = 60)
    available = res.return_code == 0
    reason = (res.stdout + " " + res.stderr).strip().replace("\n", " ")
    if available:
        reason = "VM harness ready"
    rctx.file("BUILD", "")
    rctx.file("defs.bzl", "VM_AVAILABLE = %s\nVM_REASON = %r\n" % (available, reason))

vm_harness = repository_rule(
    implementation = _vm_harness_impl,
    local = True,
    configure = True,
    environ = ["COVERBS_VM_BASE", "COVERBS_VM_QEMU", "COVERBS_VM_KVER", "PATH"],
)
