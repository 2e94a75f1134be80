#!/bin/bash
# nbdfuse + loop + ext4 over tyche-init serve-nbd (in-process target). Always cleans up.
# Needs root, FUSE, loop devices, nbdfuse (libnbd-bin), e2fsprogs. Run through
# `cargo test -p tyche-init --test nbd -- --ignored ext4` or directly with BIN=... .
set -u
BIN=${BIN:?path of the tyche-init binary}
W=$(mktemp -d /tmp/tyext4.XXXX)
SOCK=$W/nbd.sock; FUSE=$W/fuse; MNT=$W/mnt
mkdir -p $FUSE $MNT
export TYCHE_INIT_STATE_DIR=$W/state
LOOP=""; SPID=""; FPID=""
cleanup() {
  mountpoint -q $MNT && umount $MNT
  [ -n "$LOOP" ] && losetup -d $LOOP
  mountpoint -q $FUSE && fusermount3 -u $FUSE 2>/dev/null || umount -l $FUSE 2>/dev/null
  [ -n "$FPID" ] && kill $FPID 2>/dev/null
  [ -n "$SPID" ] && kill $SPID 2>/dev/null
  wait 2>/dev/null
  rm -rf $W
}
trap cleanup EXIT
timeout 300 $BIN serve-nbd --socket $SOCK --loopback-mib 256 --export ram >$W/serve.log 2>&1 & SPID=$!
for i in $(seq 50); do [ -S $SOCK ] && break; sleep 0.1; done
timeout 300 nbdfuse $FUSE "nbd+unix:///ram?socket=$SOCK" & FPID=$!
for i in $(seq 50); do [ -e $FUSE/nbd ] && break; sleep 0.1; done
ls -la $FUSE
LOOP=$(losetup -f --show $FUSE/nbd) || exit 1
echo loop=$LOOP
timeout 120 mkfs.ext4 -q -F $LOOP || exit 1
timeout 60 mount $LOOP $MNT || exit 1
head -c 20M /dev/urandom > $W/f
cp $W/f $MNT/f && sync
timeout 60 umount $MNT
echo 3 > /proc/sys/vm/drop_caches
timeout 60 mount $LOOP $MNT || exit 1
cmp $W/f $MNT/f && echo "EXT4 ROUND TRIP OK"
df -h $MNT | tail -1
umount $MNT; echo umount rc=$?; sync; timeout 60 fsck.ext4 -fn $LOOP && echo "FSCK CLEAN"
losetup -d $LOOP; LOOP=""; echo 3 > /proc/sys/vm/drop_caches
fusermount3 -u $FUSE 2>/dev/null || fusermount -u $FUSE 2>/dev/null || umount $FUSE; FPID=""
sleep 0.5; grep -E "WARN|ERROR" $W/serve.log | head; echo served-by-pid $SPID
