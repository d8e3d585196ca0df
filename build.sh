#!/usr/bin/env bash
# Install DeepInfer from this checkout into the current Python (an active venv if any).
#
#   DEEPINFER_ACCELERATOR=cpu|nvidia|ascend ./build.sh      (default cpu)
#
# cpu installs torch if it is missing (DEEPINFER_TORCH_SPEC, default torch==2.13.0); nvidia
# expects a CUDA torch to be installed already, since which build matches the driver is the
# user's call; ascend expects torch (and CANN) and installs the torch_npu release made for that
# torch (DEEPINFER_TORCH_NPU_SPEC overrides: torch-npu==X.Y.Z.* for torch X.Y.Z). Then the core
# (editable, with the test extra), the accelerator's backend plugin and every feature plugin
# that exists. Safe to rerun.
#
# nvidia also provisions DeepSeek's kernels (FlashMLA, DeepGEMM) by DEEPINFER_KERNELS and says what loaded:
#   auto (default)       prebuilt:.kernels when that folder exists, otherwise none
#   source:DIR           builds DIR/FlashMLA and DIR/DeepGEMM (whichever exist) from their source checkouts
#   prebuilt:DIR         a folder from tools/build/fetch_kernels.py (binaries lifted from a PyPI vLLM wheel)
#   pypi[:VERSION]       runs tools/build/fetch_kernels.py first (needs PyPI; vLLM VERSION, default 0.25.0, must match
#                        the installed torch/CUDA), then prebuilt:.kernels
#   triton               none: the plugin's Triton kernels serve every op
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=python3
accelerator="${DEEPINFER_ACCELERATOR:-cpu}"
accelerator="${accelerator,,}"

say() { echo "build.sh: $*"; }
die() { echo "build.sh: error: $*" >&2; exit 1; }
pip_install() { "$PYTHON" -m pip install --quiet --disable-pip-version-check "$@"; }
python_ok() { "$PYTHON" -c "$1" >/dev/null 2>&1; }

provision_deepseek_kernels() {
    local choice="${DEEPINFER_KERNELS:-auto}" route dir
    local pth="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deepinfer_kernels.pth"
    rm -f "$pth"  # a rerun with another choice must not keep an earlier folder on the path
    [[ "$choice" == auto ]] && { [[ -d .kernels ]] && choice=prebuilt:.kernels || choice=triton; }
    case "$choice" in
        pypi|pypi:*)
            local version="${choice#pypi}"; version="${version#:}"
            "$PYTHON" tools/build/fetch_kernels.py .kernels --vllm "${version:-0.25.0}" \
                --python "cpython-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')" \
                || die "DEEPINFER_KERNELS=$choice: fetching the kernels failed (see above)"
            choice=prebuilt:.kernels ;;
    esac
    case "$choice" in
        triton) route="none (DEEPINFER_KERNELS=triton or no .kernels folder)" ;;
        source:*)
            dir="${choice#source:}"
            [[ -d "$dir/FlashMLA" || -d "$dir/DeepGEMM" ]] || die "DEEPINFER_KERNELS=$choice: no FlashMLA or DeepGEMM checkout in $dir"
            for lib in FlashMLA DeepGEMM; do
                [[ -d "$dir/$lib" ]] || continue
                say "building $lib from $dir/$lib (minutes: CUDA sources)"
                pip_install --no-build-isolation "$dir/$lib" || die "building $lib from $dir/$lib failed (see above)"
            done
            route="built from source in $dir" ;;
        prebuilt:*)
            dir="${choice#prebuilt:}"
            [[ -d "$dir/deep_gemm" || -d "$dir/deepinfer_flashmla" ]] || die "DEEPINFER_KERNELS=$choice: $dir holds neither deep_gemm/ nor deepinfer_flashmla/ (make it with tools/build/fetch_kernels.py)"
            (cd "$dir" && pwd) > "$pth"
            route="prebuilt in $dir" ;;
        *) die "DEEPINFER_KERNELS=$choice is not one of auto, triton, source:DIR, prebuilt:DIR, pypi[:VERSION]" ;;
    esac
    say "DeepSeek kernels: $route; $("$PYTHON" -c 'from deepinfer_nvidia.deepseek_kernels import report; print(report())' 2>&1 | tail -1)"
}

case "$accelerator" in
    cpu|nvidia|ascend) ;;
    *) die "DEEPINFER_ACCELERATOR=${DEEPINFER_ACCELERATOR} is not one of cpu, nvidia, ascend" ;;
esac
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; DeepInfer needs Python >= 3.11"
python_ok 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "DeepInfer needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1)"
# As root outside a venv (CI, containers) pip would warn on every install.
export PIP_ROOT_USER_ACTION=ignore

case "$accelerator" in
    cpu)
        if python_ok 'import torch'; then
            say "torch $("$PYTHON" -c 'import torch; print(torch.__version__)') already installed"
        else
            spec="${DEEPINFER_TORCH_SPEC:-torch==2.13.0}"
            say "installing $spec"
            pip_install "$spec"
        fi
        ;;
    nvidia)
        python_ok 'import sys, torch; sys.exit(torch.version.cuda is None)' \
            || die "DEEPINFER_ACCELERATOR=nvidia needs a CUDA build of torch (>= 2.9) in $PYTHON; install one first (https://pytorch.org/get-started/locally/), then rerun"
        ;;
    ascend)
        python_ok 'import torch' \
            || die "DEEPINFER_ACCELERATOR=ascend needs torch in $PYTHON (the CPU build, which torch_npu extends); install it first, then rerun"
        torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
        if python_ok 'import torch_npu'; then
            say "torch_npu $("$PYTHON" -c 'import torch_npu; print(torch_npu.__version__)') already installed (torch $torch_version)"
        else
            # torch-npu X.Y.Z[.postN] requires torch==X.Y.Z.*: take the newest release for this torch, and pin
            # torch to what is installed so pip cannot swap it for another build
            spec="${DEEPINFER_TORCH_NPU_SPEC:-torch-npu==${torch_version%%+*}.*}"
            say "installing $spec (for torch $torch_version)"
            pip_install "$spec" "torch==$torch_version" \
                || die "no $spec installs next to torch $torch_version (pip index versions torch-npu lists the releases; each needs its own torch); set DEEPINFER_TORCH_NPU_SPEC or install a torch that has one"
        fi
        python_ok 'import torch_npu' \
            || die "torch_npu is installed but does not import: source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh), then rerun"
        ;;
esac

say "installing deepinfer (editable, with the test extra)"
pip_install -e ".[test,serve]"

if [[ "$accelerator" != cpu ]]; then
    backend="backends/$accelerator"
    if [[ -f "$backend/pyproject.toml" ]]; then
        say "installing the $accelerator backend plugin ($backend)"
        pip_install -e "$backend"
        [[ "$accelerator" == nvidia ]] && provision_deepseek_kernels
        [[ "$accelerator" == ascend ]] && say "NPUs: $("$PYTHON" -c 'import torch, torch_npu; print(torch.npu.device_count())' 2>&1 | tail -1); validate the backend with: $PYTHON tools/validation/ascend_validate.py"
    else
        die "the $accelerator backend plugin ($backend/pyproject.toml) is missing from this checkout"
    fi
fi

shopt -s nullglob
for feature in features/*/; do
    if [[ -f "$feature/pyproject.toml" ]]; then
        say "installing feature plugin ${feature%/}"
        pip_install -e "$feature"
    fi
done

# The README's commands run `python`; say so if it is not the interpreter we installed into.
if command -v python >/dev/null && [[ "$(python -c 'import sys; print(sys.prefix)' 2>/dev/null)" != "$("$PYTHON" -c 'import sys; print(sys.prefix)')" ]]; then
    say "warning: 'python' is not the interpreter deepinfer was installed into ($PYTHON); use $PYTHON"
fi
say "done ($accelerator): $("$PYTHON" -c 'import deepinfer, torch; print("deepinfer", deepinfer.__version__, "with torch", torch.__version__)')"
