# sourced by the run_s16*.sh and run_s17*.sh scripts: the working tree as a package in /tmp/pkg_new (kernels,
# models, passes linked), M3C_AUTOTUNE=0, cwd /tmp; results under $O (copied to $OUT by each script)
R=${R:-$PWD}; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
cp $R/cli.py /tmp/pkg_new/m3compile/cli.py 2>/dev/null
NEW=/tmp/pkg_new; X=$R/benchmarks/experiments
export M3C_AUTOTUNE=0 PYTHONPATH=$NEW PYTHONUNBUFFERED=1; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >&2
