#!/usr/bin/env bash
# Build the image `python -m labsupport grade --container IMAGE` runs each learner's kernel in, with
# no image registry: a Debian root file system made by mmdebstrap from Debian's packages, the course's
# Python packages installed into it from wheels pip fetched (or found on this disk), then
# `podman import` (or `docker import`). Needs mmdebstrap and podman (apt-get install mmdebstrap podman),
# a checkout of the course, and its Python (.venv, from `make setup`), whose package versions the
# image copies. Runs as root, or as an ordinary user with subuids (mmdebstrap then uses a user
# namespace, and the image lands in that user's own rootless podman store).
#
#   bash scripts/grading/build_image.sh                        # course-grader:COMMIT
#   bash scripts/grading/build_image.sh course-grader:week3    # another name
#
# Environment: PYTHON (the grader's Python; default .venv/bin/python), ENGINE (podman or docker;
# default podman), SUITE (Debian release; default bookworm, whose python3 is 3.11 like the wheels),
# ROOTFS (also keep the root file system's tarball at this path), PRUNE=0 (keep what a kernel never
# uses: torch's C++ headers and test binaries, Triton's CUDA tools and profiler libraries).
#
# The image holds the course at HEAD (commit first: uncommitted changes are not in it), labelled
# with its fingerprint, which `grade --container` compares with its own before grading. To hand it
# to another user's rootless podman: `podman save IMAGE | sudo -u USER podman load`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
cd "$root"
commit=$(git rev-parse HEAD)
tag=${1:-course-grader:$(git rev-parse --short HEAD)}
python=${PYTHON:-$root/.venv/bin/python}
engine=${ENGINE:-podman}
suite=${SUITE:-bookworm}
for tool in mmdebstrap "$engine" "$python"; do
    command -v "$tool" >/dev/null || { echo "build_image: $tool not found (apt-get install mmdebstrap podman; make setup)" >&2; exit 2; }
done
if ! git diff --quiet HEAD -- labsupport pyproject.toml; then
    echo "build_image: warning: labsupport/ has uncommitted changes; the image holds HEAD ($commit)," >&2
    echo "             so grade --container will refuse it from this working tree until you commit" >&2
fi
start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/course-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/wheels"

echo "== the course at $commit, as a wheel"
git archive --format=tar HEAD | tar -x -C "$work/src"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/wheels" "$work/src"

echo "== wheels of the kernel's packages, at the grader's versions"
"$python" -m pip freeze --exclude-editable | grep -v -i '^labsupport' > "$work/constraints.txt"
"$python" -m pip download --quiet --only-binary=:all: --dest "$work/wheels" \
    --constraint "$work/constraints.txt" -r "$here/image-requirements.txt"
cp "$here/image-requirements.txt" "$work/wheels/"

# Run by mmdebstrap once Debian's packages are in, with the root file system as $1 (in a user
# namespace when not root): a venv of Debian's python3 with the wheels, and nothing else.
cat > "$work/customize.sh" <<'EOF'
#!/bin/sh
set -eu
rootfs=$1
inside() {  # a command in the root file system, with none of this machine's settings (PIP_*, PATH)
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$rootfs" "$@"
}
mkdir -p "$rootfs/tmp/wheels"
cp "$WHEELS"/* "$rootfs/tmp/wheels/"
inside python3 -m venv /opt/course
inside /opt/course/bin/python -m pip install --quiet --no-index --no-cache-dir --disable-pip-version-check \
    --find-links /tmp/wheels -r /tmp/wheels/image-requirements.txt labsupport
inside /opt/course/bin/python -m pip uninstall --quiet --yes pip setuptools
site=$(echo "$rootfs"/opt/course/lib/python3*/site-packages)
if [ "${PRUNE:-1}" != 0 ]; then
    # never used by a kernel in this image, which has no C compiler and no GPU
    before=$(du -sm "$site" | cut -f1)
    rm -rf "$site"/torch/include "$site"/torch/test "$site"/triton/instrumentation \
        "$site"/triton/backends/nvidia/bin "$site"/triton/backends/nvidia/include \
        "$site"/triton/backends/nvidia/lib/cupti "$site"/triton/backends/amd/include
    find "$site"/torch/bin -type f ! -name torch_shm_manager -delete
    echo "pruned $((before - $(du -sm "$site" | cut -f1))) MB of $before MB (PRUNE=0 keeps it)"
fi
rm -rf "$rootfs/tmp/wheels" "$rootfs"/var/cache/* "$rootfs"/var/log/*
# the kernel must start: the checks, the labs' packages, the interpreter mode
inside env TRITON_INTERPRET=1 /opt/course/bin/python -c \
    "import ipykernel, torch, triton, transformers, fastapi, labsupport.checks; print('torch', torch.__version__, 'triton', triton.__version__)"
inside /opt/course/bin/python -c \
    "import json; from labsupport.course.shard import course_fingerprint; print(json.dumps(course_fingerprint()))" \
    > "$WHEELS/../fingerprint.json"
EOF
chmod +x "$work/customize.sh"

echo "== the root file system (mmdebstrap $suite), the packages installed into it"
export WHEELS=$work/wheels PRUNE=${PRUNE:-1}
# essential: no apt, no init; python3 and the C++ runtime the wheels link against (libstdc++6)
mmdebstrap --variant=essential --include=python3,python3-venv,libstdc++6 \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook="$work/customize.sh \"\$1\"" \
    "$suite" "$work/rootfs.tar"

echo "== $engine import"
labels=$("$python" - "$work/fingerprint.json" "$commit" <<'EOF'
import json, sys
found = json.load(open(sys.argv[1]))
print(f"LABEL org.labsupport.commit={sys.argv[2]} org.labsupport.version={found['labsupport']} "
      f"org.labsupport.code_sha256={found['code_sha256']} org.labsupport.lab_checks_sha256={found['lab_checks_sha256']}")
EOF
)
"$engine" import --change 'ENV PATH=/opt/course/bin:/usr/local/bin:/usr/bin:/bin' \
    --change 'WORKDIR /tmp' --change 'CMD ["python"]' \
    --change "$labels" --quiet "$work/rootfs.tar" "$tag" >/dev/null
if [ -n "${ROOTFS:-}" ]; then
    cp "$work/rootfs.tar" "$ROOTFS"
fi
size=$("$engine" image inspect --format '{{.Size}}' "$tag")
echo "built $tag: $((size / 1000000)) MB, in $(($(date +%s) - start)) s (course $commit)"
echo "grade with: $python -m labsupport grade SUBMISSIONS --container $tag"
