"""coverbs_install: an executable that lays out an installed coverbs.

`bazel run //:install -- PREFIX` writes
  PREFIX/include/...                       every header of this workspace
                                           that `deps` compile with
  PREFIX/lib/libcoverbs.a                  the static libraries of `deps`
                                           (this workspace's only), merged
  PREFIX/lib/pkgconfig/coverbs.pc          cflags and the system libraries
                                           `deps` link with (@system's
                                           linkopts, as Bazel passes them)
  PREFIX/lib/cmake/coverbs/coverbsConfig.cmake  the imported target
                                           coverbs::coverbs
The link flags are taken from the targets' CcInfo, so the .pc file and the
CMake target list exactly what a Bazel build of the same targets links.
"""

def _is_ours(f):
    return f.owner != None and f.owner.workspace_name == "" and not f.short_path.startswith("../")

def _coverbs_install_impl(ctx):
    headers = {}
    archives = []
    flags = []
    for dep in ctx.attr.deps:
        cc = dep[CcInfo]
        for h in cc.compilation_context.headers.to_list():
            if _is_ours(h):
                headers[h.short_path] = h
        for li in cc.linking_context.linker_inputs.to_list():
            if li.owner.workspace_name == "":
                for lib in li.libraries:
                    a = lib.static_library or lib.pic_static_library
                    if a and a not in archives:
                        archives.append(a)
            for f in li.user_link_flags:
                if f not in flags:
                    flags.append(f)
    manifest = ctx.actions.declare_file(ctx.label.name + ".manifest")
    lines = ["H " + p for p in sorted(headers.keys())]
    lines += ["A " + a.short_path for a in archives]
    lines += ["L " + f for f in flags]
    ctx.actions.write(manifest, "\n".join(lines) + "\n")
    exe = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.expand_template(
        template = ctx.file._script,
        output = exe,
        substitutions = {
            "@MANIFEST@": manifest.short_path,
            "@VERSION@": ctx.attr.version,
        },
        is_executable = True,
    )
    files = [manifest, ctx.file._script] + headers.values() + archives
    return [DefaultInfo(
        executable = exe,
        runfiles = ctx.runfiles(files = files),
    )]

coverbs_install = rule(
    implementation = _coverbs_install_impl,
    executable = True,
    attrs = {
        "deps": attr.label_list(providers = [CcInfo]),
        "version": attr.string(default = "0"),
        "_script": attr.label(
            default = "//tools:install.sh.in",
            allow_single_file = True,
        ),
    },
)
