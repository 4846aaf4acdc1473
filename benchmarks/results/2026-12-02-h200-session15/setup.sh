# sourced by the run_s15*.sh scripts: the working tree as a package in /tmp/pkg_new (kernels, models, passes linked),
# OLD = .carry/old15 (session 14's last commit, c255270), M3C_AUTOTUNE=0, cwd /tmp
R=${R:-$PWD}; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
NEW=/tmp/pkg_new; OLD=$R/.carry/old15; X=$R/benchmarks/experiments
export M3C_AUTOTUNE=0 PYTHONPATH=$NEW; cd /tmp
