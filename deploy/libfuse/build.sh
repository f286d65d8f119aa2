#!/bin/sh
# Kernel FUSE passthrough for qosfs: libfuse >= 3.17 and pyfuse3 patched to expose it.
#
#   deploy/libfuse/build.sh VENV [BUILD_DIR]     libfuse + patched pyfuse3 into VENV
#   deploy/libfuse/build.sh VENV [BUILD_DIR] passthrough_hp
#                                                 also libfuse's C++ example passthrough_hp
#                                                 (the bench's peer), from the same source
#   DESTDIR=D deploy/libfuse/build.sh VENV BUILD_DIR installed
#                                                 the same into an installed virtualenv:
#                                                 VENV is its path at run time (absolute),
#                                                 its files are under D (may be empty)
#
# Called by `make deps`, and by `make install` (installed). Idempotent: a stamp in the prefix names what was built, and a
# second run with the same versions and patch does nothing. On failure it prints one
# line saying why and exits 1; the Makefile then goes on with the system's libfuse (the
# mount works, kernel passthrough is reported unavailable).
#
# Why each choice (README.md, "Kernel passthrough", has the costs):
# - libfuse: the system's when pkg-config finds fuse3 >= 3.17.3. Otherwise Debian's own
#   source package, fetched with apt-get through a source list private to this build (the
#   system's apt configuration is not touched), from Debian testing (forky; sid has the
#   same 3.18.3-1). 3.18.3 has upstream's want/want_ext conversion fixes of 3.17.3 in full;
#   upstream 3.17.2 lacks them, and pyfuse3 writes conn.want directly. (Trixie's 3.17.2-3
#   carries Debian's backport, which makes the conversion non-fatal, and negotiated
#   passthrough in a trial here too; the upstream release was preferred to a partial
#   backport.) The version is pinned so every machine builds the same thing; if testing
#   has moved on, its current fuse3 is taken if it is >= 3.17.3.
# - meson and ninja from PyPI, in a venv of the build's own (nothing system-wide).
# - Only the library (no utils, examples, tests, io_uring): fusermount3 stays the
#   system's. libfuse runs $bindir/fusermount3, so bindir is set to /usr/bin (nothing is
#   installed there) and unprivileged mounts keep using the system's setuid helper.
# - The prefix is VENV/opt/libfuse: it lives and dies with the venv whose pyfuse3 is linked
#   to it (rpath, no LD_LIBRARY_PATH). The sources and the build tree stay in BUILD_DIR
#   (build/libfuse; `make clean` removes both, like the venv).
# - An installed venv (make install) is staged under DESTDIR and used from VENV: libfuse
#   is configured with the run-time prefix and installed with meson's DESTDIR, pyfuse3
#   compiled against the staged headers (pkg-config's sysroot) and linked with the
#   run-time rpath, so no installed file names DESTDIR. Its build tree is bld-installed,
#   apart from make deps' bld (passthrough_hp is built there); the sources are shared.
# - pyfuse3 from its sdist with deploy/libfuse/pyfuse3-passthrough.patch (written to be
#   proposed upstream); its C file is regenerated from the patched Cython source.
#   More on top, each for upstream on its own (README.md says why):
#   pyfuse3-no-splice-read.patch stops libfuse's pipe churn before every request;
#   pyfuse3-read-queued.patch reads a queued request without waiting for readiness.
#   pyfuse3-read-inline.patch runs a request's handler in the task that read it,
#   handing the reading on to another task only if the handler suspends;
#   pyfuse3-busy-poll.patch (last) polls for the next request a while before sleeping.
# - libfuse-session-adopt.patch, applied to the source build only (README.md, "Live
#   handover"): a new process can serve a mounted, initialised connection without INIT;
#   pyfuse3-adopt.patch exposes it. Against the system's libfuse pyfuse3 still builds,
#   and reports ADOPT_SUPPORTED = False.
# - libfuse-req-unique.patch (after the adopt patch) and pyfuse3-req-unique.patch: a
#   request's unique id (RequestContext.unique), so that a successor of a daemon that
#   died answers a resent request with the outcome its predecessor recorded (README.md,
#   "Resent requests"); against the system's libfuse REQUEST_UNIQUE_SUPPORTED = False.
set -eu

build=$(realpath -m "${2:-build/libfuse}")
what=${3:-library}
case $what in
    library|passthrough_hp)
        venv=$(realpath -m "$1"); dest=; bld=$build/bld; log=$build/build.log ;;
    installed)
        case $1 in
            /*) venv=$1 ;;
            *) echo "build.sh: an installed VENV is its absolute path at run time: $1" >&2
               exit 2 ;;
        esac
        dest=${DESTDIR:-}; bld=$build/bld-installed; log=$build/installed.log ;;
    *) echo "build.sh: unknown target $what (library, passthrough_hp, installed)" >&2
       exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
patch_file=$here/pyfuse3-passthrough.patch
more_patches="$here/pyfuse3-no-splice-read.patch $here/pyfuse3-read-queued.patch $here/pyfuse3-adopt.patch
    $here/pyfuse3-req-unique.patch $here/pyfuse3-read-inline.patch $here/pyfuse3-busy-poll.patch"
libfuse_patches="$here/libfuse-session-adopt.patch $here/libfuse-req-unique.patch"

LIBFUSE_DEB_VERSION=${LIBFUSE_DEB_VERSION:-3.18.3-1}
LIBFUSE_MIN=3.17.3
PYFUSE3_VERSION=3.5.0   # the version the patch is written against
DEB_SUITE=${DEB_SUITE:-forky}
DEB_MIRROR=${DEB_MIRROR:-http://deb.debian.org/debian}

root=$dest$venv                 # where the venv's files are now
prefix=$venv/opt/libfuse        # libfuse at run time: what pyfuse3's rpath names
staged=$dest$prefix             # and where its files are now (the same without DESTDIR)
stamp=$staged/.stamp            # what the venv's pyfuse3 was built with
lib_stamp=$staged/.libfuse      # which libfuse the prefix holds
mkdir -p "$build"

fail() {
    echo "kernel passthrough not built: $1 (log: $log); qosfs goes on with the system's" \
        "libfuse $(pkg-config --modversion fuse3 2>/dev/null || echo '?'), without passthrough" >&2
    exit 1
}
# Runs a step with its output in the log; fails with the step's name.
step() {
    name=$1; shift
    echo "== $name: $*" >>"$log"
    "$@" >>"$log" 2>&1 || fail "$name failed"
}

if pkg-config --atleast-version=$LIBFUSE_MIN fuse3 2>/dev/null; then
    source_kind="system libfuse $(pkg-config --modversion fuse3)"
else
    source_kind="Debian fuse3 $LIBFUSE_DEB_VERSION +"
    for libfuse_patch in $libfuse_patches; do
        source_kind="$source_kind $(basename "$libfuse_patch" .patch)"
    done
    source_kind="$source_kind $(cat $libfuse_patches | sha256sum | cut -c1-16)"
fi
patch_sum=$(cat "$patch_file" $more_patches | sha256sum | cut -c1-16)
script_sum=$(sha256sum "$0" | cut -c1-16)
want="$source_kind; pyfuse3 $PYFUSE3_VERSION; patch $patch_sum; script $script_sum"

build_library() {
    case $source_kind in system*) return 0 ;; esac
    if [ -f "$lib_stamp" ] && [ "$(cat "$lib_stamp")" = "$source_kind" ]; then
        return 0
    fi
    # Debian's source package through a private source list: apt's own signature and
    # checksum checks, nothing under /etc/apt read or written.
    apt_dir=$build/apt
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$build/src"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $DEB_MIRROR $DEB_SUITE main" \
        >"$apt_dir/sources.list"
    set -- -o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache" \
        -o APT::Sandbox::User=root -qq
    if ! ls "$build/src/fuse3_${LIBFUSE_DEB_VERSION}.dsc" >/dev/null 2>&1; then
        step "apt-get update (private deb-src list: $DEB_SUITE)" apt-get "$@" update
        version=$LIBFUSE_DEB_VERSION
        if ! (cd "$build/src" && apt-get "$@" source --download-only "fuse3=$version") \
                >>"$log" 2>&1; then
            version=$(apt-cache "$@" showsrc fuse3 2>>"$log" | sed -n 's/^Version: //p' | head -n1)
            [ -n "$version" ] || fail "no fuse3 source package reachable ($DEB_MIRROR $DEB_SUITE)"
            dpkg --compare-versions "$version" ge $LIBFUSE_MIN || \
                fail "$DEB_SUITE has fuse3 $version, older than $LIBFUSE_MIN"
            echo "fuse3 $LIBFUSE_DEB_VERSION is gone from $DEB_SUITE: building its $version" >&2
            (cd "$build/src" && step "apt-get source fuse3=$version" \
                apt-get "$@" source --download-only "fuse3=$version")
            LIBFUSE_DEB_VERSION=$version
        fi
        rm -rf "$apt_dir/lists" "$apt_dir/cache"   # 25 MB of indexes, needed only once
    fi
    # meson and ninja from PyPI, in the build's own venv.
    tools=$build/tools
    if [ ! -x "$tools/bin/meson" ] || [ ! -x "$tools/bin/ninja" ]; then
        step "venv for meson" "$root/bin/python" -m venv "$tools"
        step "meson and ninja from PyPI" "$tools/bin/python" -m pip install -q meson ninja
    fi
    upstream=${LIBFUSE_DEB_VERSION%-*}
    srcdir=$build/src/fuse3-$upstream
    rm -rf "$srcdir"
    (cd "$build/src" && step "dpkg-source -x" dpkg-source -x "fuse3_${LIBFUSE_DEB_VERSION}.dsc")
    for libfuse_patch in $libfuse_patches; do
        step "patch libfuse ($(basename "$libfuse_patch"))" patch -d "$srcdir" -p1 -i "$libfuse_patch"
    done
    rm -rf "$bld"
    step "meson setup" env PATH="$tools/bin:$PATH" "$tools/bin/meson" setup "$bld" "$srcdir" \
        --prefix="$prefix" --libdir=lib --bindir=/usr/bin --buildtype=release \
        -Dexamples=false -Dutils=false -Dtests=false -Denable-io-uring=false \
        -Duseroot=false -Dinitscriptdir=
    step "ninja" env PATH="$tools/bin:$PATH" ninja -C "$bld"
    # The prefix is replaced only once the new library is built: until then the venv's
    # pyfuse3 keeps the one it is linked to.
    rm -rf "$staged"
    step "ninja install" env PATH="$tools/bin:$PATH" DESTDIR="$dest" ninja -C "$bld" install
    echo "$source_kind" >"$lib_stamp"
}

build_pyfuse3() {
    sdist_dir=$build/pyfuse3
    rm -rf "$sdist_dir"
    mkdir -p "$sdist_dir"
    step "pip download pyfuse3 $PYFUSE3_VERSION (sdist)" "$root/bin/python" -m pip download \
        -q --no-binary :all: --no-deps -d "$sdist_dir" "pyfuse3==$PYFUSE3_VERSION"
    step "unpack pyfuse3" tar xzf "$sdist_dir/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$sdist_dir"
    tree=$sdist_dir/pyfuse3-$PYFUSE3_VERSION
    step "patch pyfuse3" patch -d "$tree" -p1 -i "$patch_file"
    for more in $more_patches; do
        step "patch pyfuse3 ($(basename "$more"))" patch -d "$tree" -p1 -i "$more"
    done
    rm -f "$tree/src/pyfuse3/__init__.c"   # regenerated from the patched .pyx by Cython
    # Staged, the .pc file names the run-time prefix: the sysroot points pkg-config's -I
    # and -L at the staged copy, while the rpath names the run-time one. Until the venv
    # is in place, the check finds the staged library through LD_LIBRARY_PATH (the rpath
    # is a RUNPATH, which it precedes; a run-time one that does not exist yet is skipped).
    # The compiler's file names (debug info) lose the DESTDIR prefix likewise.
    sysroot=${PKG_CONFIG_SYSROOT_DIR:-}; library_path=${LD_LIBRARY_PATH:-}; cflags=${CFLAGS:-}
    case $source_kind in
        system*) pc_path=${PKG_CONFIG_PATH:-}; ldflags=${LDFLAGS:-} ;;
        *) pc_path=$staged/lib/pkgconfig; ldflags="-Wl,-rpath,$prefix/lib ${LDFLAGS:-}"
           sysroot=$dest
           if [ -n "$dest" ]; then
               library_path=$staged/lib${library_path:+:$library_path}
               cflags="-ffile-prefix-map=$dest= $cflags"
           fi ;;
    esac
    step "build and install patched pyfuse3" env PKG_CONFIG_PATH="$pc_path" \
        PKG_CONFIG_SYSROOT_DIR="$sysroot" LDFLAGS="$ldflags" CFLAGS="$cflags" \
        "$root/bin/python" -m pip install -q --no-deps --force-reinstall "$tree"
    step "check pyfuse3" env LD_LIBRARY_PATH="$library_path" "$root/bin/python" -c \
        'import pyfuse3, sys; sys.exit(0 if pyfuse3.PASSTHROUGH_SUPPORTED else 1)'
    rm -rf "$tree"   # the build tree (20 MB); the sdist stays
}

build_passthrough_hp() {
    case $source_kind in system*) fail "passthrough_hp comes from the source build (system libfuse in use)" ;; esac
    if [ ! -f "$bld/build.ninja" ]; then   # build/ removed, the venv kept
        rm -f "$lib_stamp"
        build_library
    fi
    step "meson configure (examples)" env PATH="$build/tools/bin:$PATH" \
        "$build/tools/bin/meson" configure "$bld" -Dexamples=true
    step "ninja passthrough_hp" env PATH="$build/tools/bin:$PATH" \
        ninja -C "$bld" example/passthrough_hp
    echo "$bld/example/passthrough_hp"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    :
else
    : >"$log"
    [ -x "$root/bin/python" ] || fail "no venv at $root"
    command -v cc >/dev/null || fail "no C compiler (build-essential)"
    start=$(date +%s)
    build_library
    build_pyfuse3
    mkdir -p "$staged"
    echo "$want" >"$stamp"
    echo "kernel passthrough: pyfuse3 $PYFUSE3_VERSION (patched) on $source_kind," \
        "built in $(($(date +%s) - start)) s"
fi
if [ "$what" = passthrough_hp ]; then
    build_passthrough_hp
fi
