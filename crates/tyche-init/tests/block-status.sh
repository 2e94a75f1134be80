#!/bin/bash
# Block status with the real NBD clients: a sparse 64 MiB file export (data at four places, the
# rest holes) served by `tyched` over the TCP transport, inside a network namespace made here,
# and `tyche-init serve-nbd --tcp`. nbdinfo --map and qemu-img map see the holes, qemu-img
# convert and nbdcopy copy it sparse (du and contents compared), nbdsh (python3-libnbd) checks
# structured replies, base:allocation, REQ_ONE, the block sizes and hole chunks in reads
# (pread_structured); a python3 raw-socket client checks extended headers; nbdinfo --map again
# through the task-per-request path (--nbd-io tasks). Root only.
# Run: TYCHED=path BIN=path bash block-status.sh
set -u
BIN=${BIN:?path of the tyche-init binary}; TYCHED=${TYCHED:?path of the tyched binary}
for t in nbdinfo nbdcopy nbdsh qemu-img; do
  command -v $t >/dev/null || { echo "SKIP: no $t (apt-get install libnbd-bin python3-libnbd qemu-utils)"; exit 0; }
done
W=$(mktemp -d /var/tmp/tybs.XXXX); NS=tybs$$; TPID=""; IPID=""
cleanup() {
  [ -n "$IPID" ] && kill $IPID 2>/dev/null; [ -n "$TPID" ] && kill $TPID 2>/dev/null
  wait 2>/dev/null; ip netns del $NS 2>/dev/null; rm -rf $W
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; tail -n 5 $W/init.log $W/target.log; exit 1; }
ip netns add $NS && ip -n $NS link set lo up || exit 1
export TYCHE_INIT_STATE_DIR=$W/state

# 64 MiB, holes but for 1 MiB at 0, 64 KiB at 10 MiB, 4 KiB at 40 MiB and 1 MiB at 62 MiB.
IMG=$W/sparse.img
truncate -s 64M $IMG
dd if=/dev/urandom of=$IMG bs=1M count=1 conv=notrunc status=none
dd if=/dev/urandom of=$IMG bs=64K count=1 seek=160 conv=notrunc status=none
dd if=/dev/urandom of=$IMG bs=4K count=1 seek=10240 conv=notrunc status=none
dd if=/dev/urandom of=$IMG bs=1M count=1 seek=62 conv=notrunc status=none
sync $IMG
DATA=$(( (1 << 20) + (64 << 10) + 4096 + (1 << 20) ))
[ $(du -k $IMG | cut -f1) -lt 4096 ] || { echo "SKIP: $W does not keep files sparse"; exit 0; }

cat >$W/tyched.toml <<EOT
ifaces = ["lo"]
transport = "tcp"
tcp_listen = "127.0.0.1:7789"

[[export]]
name = "sparse"
path = "$IMG"
EOT
start_target() {
  timeout 600 ip netns exec $NS $TYCHED serve --config $W/tyched.toml >$W/target.out 2>>$W/target.log & TPID=$!
  sleep 1
}
start_target
SOCK=$W/nbd.sock
start_init() {
  timeout 600 ip netns exec $NS $BIN serve-nbd --socket $SOCK --tcp 127.0.0.1:7789 --export sparse "$@" \
    >$W/init.out 2>$W/init.log & IPID=$!
  for i in $(seq 100); do [ -S $SOCK ] && break; sleep 0.1; done
  [ -S $SOCK ] || fail "initiator did not start"
}
start_init
URI="nbd+unix:///sparse?socket=$SOCK"

# nbdinfo --map: "offset length type description" lines; type 0 is data, 3 hole,zero.
timeout 60 nbdinfo --map "$URI" >$W/map.txt || fail "nbdinfo --map"
data=$(awk '$3 == 0 { s += $2 } END { print s + 0 }' $W/map.txt)
holes=$(awk '$3 == 3 { s += $2 } END { print s + 0 }' $W/map.txt)
[ "$data" = "$DATA" ] && [ $((data + holes)) = $((64 << 20)) ] || { cat $W/map.txt; fail "nbdinfo map: $data data, $holes holes"; }
grep -q "hole,zero" $W/map.txt || fail "no hole,zero in the map"
echo "BLOCK STATUS NBDINFO MAP OK ($data bytes of data, $holes of holes)"

# qemu-img map: the same data ranges.
timeout 60 qemu-img map --output=json "$URI" >$W/qmap.json || fail "qemu-img map"
qdata=$(/usr/bin/python3 -c 'import json,sys; print(sum(e["length"] for e in json.load(open(sys.argv[1])) if e["data"]))' $W/qmap.json)
[ "$qdata" = "$DATA" ] || { cat $W/qmap.json; fail "qemu-img map: $qdata bytes of data"; }
echo "BLOCK STATUS QEMU-IMG MAP OK"

# Sparse copies: the holes stay holes, the contents are the same.
timeout 120 qemu-img convert -f raw -O raw "$URI" $W/convert.img || fail "qemu-img convert"
cmp $W/convert.img $IMG || fail "qemu-img convert: contents differ"
[ $(du -k $W/convert.img | cut -f1) -lt 4096 ] || fail "qemu-img convert: not sparse ($(du -k $W/convert.img))"
echo "SPARSE QEMU-IMG CONVERT OK ($(du -k $IMG | cut -f1) KiB -> $(du -k $W/convert.img | cut -f1) KiB)"
truncate -s 64M $W/nbdcopy.img
timeout 120 nbdcopy "$URI" $W/nbdcopy.img || fail "nbdcopy"
cmp $W/nbdcopy.img $IMG || fail "nbdcopy: contents differ"
[ $(du -k $W/nbdcopy.img | cut -f1) -lt 4096 ] || fail "nbdcopy: not sparse ($(du -k $W/nbdcopy.img))"
echo "SPARSE NBDCOPY OK ($(du -k $W/nbdcopy.img | cut -f1) KiB)"

# libnbd's own view: structured replies, base:allocation, REQ_ONE, block sizes, reads.
cat >$W/check.py <<'EOT'
import os, sys
import nbd
uri, img, want_data = os.environ["URI"], os.environ["IMG"], int(os.environ["DATA"])
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(uri)
assert h.get_structured_replies_negotiated(), "structured replies not negotiated"
assert h.can_meta_context("base:allocation"), "base:allocation not negotiated"
assert h.get_block_size(nbd.SIZE_MINIMUM) == 512, h.get_block_size(nbd.SIZE_MINIMUM)
assert h.get_block_size(nbd.SIZE_PREFERRED) == 4096, h.get_block_size(nbd.SIZE_PREFERRED)
assert h.get_block_size(nbd.SIZE_MAXIMUM) == 32 << 20, h.get_block_size(nbd.SIZE_MAXIMUM)
assert h.can_cache()
size = h.get_size()
def status(length, offset, flags=0):
    got = []
    def cb(ctx, off, entries, err):
        assert ctx == "base:allocation", ctx
        got.append((off, list(entries)))
    h.block_status(length, offset, cb, flags=flags)
    assert len(got) == 1, got
    assert got[0][0] == offset, got
    e = got[0][1]
    return [(e[i], e[i + 1]) for i in range(0, len(e), 2)]
ext = status(size, 0)
assert ext[0] == (1 << 20, 0), ext
assert ext[1][1] == 3, ext
assert sum(l for l, _ in ext) <= size
one = status(size, 0, nbd.CMD_FLAG_REQ_ONE)
assert one == [(1 << 20, 0)], one
mid = status(8192, 10 << 20)
assert mid[0][1] == 0 and sum(l for l, _ in mid) <= 8192, mid
hole = status(4096, 20 << 20)
assert hole == [(4096, 3)], hole
# Walk the whole export as clients do: ask again from where the answer ended.
off, data = 0, 0
while off < size:
    ext = status(min(size - off, 1 << 30), off)
    for l, f in ext:
        if f == 0:
            data += l
        off += l
assert data == want_data, data
with open(img, "rb") as f:
    want = f.read()
for o, n in [(0, 4096), (10 << 20, 65536), (20 << 20, 8192), (62 << 20, 1 << 20), (1000 * 512, 512)]:
    assert h.pread(n, o) == want[o:o + n], (o, n)
# Hole-aware reads: 4 MiB from 9 MiB is a 1 MiB hole, 64 KiB of data, then holes: hole chunks
# for the holes, data chunks for the data, the file's contents; with DF one data chunk.
chunks = []
def cb(buf, off, status, err):
    chunks.append((status, off, len(buf)))
    return 0
o, n = 9 << 20, 4 << 20
assert h.pread_structured(n, o, cb) == want[o:o + n]
holes = sum(l for s, _, l in chunks if s == nbd.READ_HOLE)
data = [(off, l) for s, off, l in chunks if s == nbd.READ_DATA]
assert holes == n - 65536 and data == [(10 << 20, 65536)], chunks
chunks.clear()
assert h.pread_structured(n, o, cb, flags=nbd.CMD_FLAG_DF) == want[o:o + n]
assert [s for s, _, _ in chunks] == [nbd.READ_DATA], chunks
h.shutdown()
print("NBDSH CHECKS OK")
EOT
URI=$URI IMG=$IMG DATA=$DATA PATH=/usr/bin:$PATH timeout 60 nbdsh -c "exec(open('$W/check.py').read())" 2>&1 | tail -n 5 >$W/nbdsh.out
grep -q "NBDSH CHECKS OK" $W/nbdsh.out || { cat $W/nbdsh.out; fail "nbdsh checks"; }
echo "BLOCK STATUS NBDSH OK"

# Extended headers on a raw socket (libnbd 1.14 cannot ask for them): block status of the whole
# export in one 64-bit request (NBD_REPLY_TYPE_BLOCK_STATUS_EXT), a hole-aware read compared
# with the file, a write without NBD_CMD_FLAG_PAYLOAD_LEN (as qemu sends them) taken with its payload.
cat >$W/ext.py <<'EOT'
import os, socket, struct
sock, img, want_data = os.environ["SOCK"], os.environ["IMG"], int(os.environ["DATA"])
s = socket.socket(socket.AF_UNIX); s.connect(sock); s.settimeout(30)
def rd(n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b)); assert c, "closed"; b += c
    return b
assert rd(18)[:16] == b"NBDMAGICIHAVEOPT"
s.sendall(struct.pack(">I", 3))
def opt(o, d=b""):
    s.sendall(b"IHAVEOPT" + struct.pack(">II", o, len(d)) + d)
    out = []
    while True:
        _, oo, t, n = struct.unpack(">QIII", rd(20)); out.append((t, rd(n)))
        if t == 1 or t & 0x80000000: return out
assert opt(11) == [(1, b"")], "EXTENDED_HEADERS"
assert opt(8)[-1][0] == 0x8000000a, "STRUCTURED_REPLY after extended headers"
name = b"sparse"; q = b"base:allocation"
r = opt(10, struct.pack(">I", len(name)) + name + struct.pack(">II", 1, len(q)) + q)
assert r[0][0] == 4 and r[-1][0] == 1, r
r = opt(7, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
size, flags = struct.unpack(">QH", r[0][1][2:12])
def req(cmd, cookie, off, n, flags=0):
    s.sendall(struct.pack(">IHHQQQ", 0x21e41c71, flags, cmd, cookie, off, n))
def chunk():
    magic, f, t, cookie, off, n = struct.unpack(">IHHQQQ", rd(32))
    assert magic == 0x6e8a278c, hex(magic)
    return f, t, cookie, off, rd(n)
req(7, 1, 0, size)
f, t, cookie, _, p = chunk()
assert (f, t, cookie) == (1, 6, 1), (f, t)
ctx, count = struct.unpack(">II", p[:8]); assert len(p) == 8 + 16 * count
ext = [struct.unpack(">QQ", p[8 + 16 * i:24 + 16 * i]) for i in range(count)]
covered = sum(l for l, _ in ext); data = sum(l for l, st in ext if st == 0)
assert ext[0] == (1 << 20, 0), ext
with open(img, "rb") as fh: want = fh.read()
o, n = 9 << 20, 4 << 20
req(0, 2, o, n)
got, kinds = bytearray(b"\xff" * n), []
while True:
    f, t, cookie, off, p = chunk(); assert cookie == 2 and off == o
    at = struct.unpack(">Q", p[:8])[0] - o
    if t == 1: got[at:at + len(p) - 8] = p[8:]; kinds.append("data")
    elif t == 2: l = struct.unpack(">I", p[8:12])[0]; got[at:at + l] = bytes(l); kinds.append("hole")
    else: raise AssertionError(t)
    if f & 1: break
assert bytes(got) == want[o:o + n] and "hole" in kinds, kinds
# A write without NBD_CMD_FLAG_PAYLOAD_LEN, as qemu sends every write: its payload (the file's own
# first 4 KiB, so nothing changes) is read and written; then a read still parses.
req(1, 3, 0, 4096); s.sendall(want[:4096])
f, t, cookie, _, p = chunk()
assert (f, t, cookie) == (1, 0, 3), (f, t, cookie, p)
req(0, 4, 0, 512)
f, t, cookie, _, p = chunk()
assert (t, cookie, p[8:]) == (1, 4, want[:512]), (t, cookie)
req(2, 5, 0, 0)
print("EXTENDED OK", count, "extents covering", covered, "data", data, "chunks", kinds)
EOT
SOCK=$SOCK IMG=$IMG DATA=$DATA timeout 60 /usr/bin/python3 $W/ext.py >$W/ext.out 2>&1 || { cat $W/ext.out; fail "extended headers"; }
echo "BLOCK STATUS EXTENDED HEADERS OK ($(cat $W/ext.out))"

# The task-per-request path answers the same (a new target: its TCP listener served the first
# initiator's connection).
kill $IPID $TPID; wait $IPID $TPID 2>/dev/null; IPID=""; TPID=""; rm -f $SOCK
start_target
start_init --nbd-io tasks
timeout 60 nbdinfo --map "$URI" >$W/map-tasks.txt || fail "nbdinfo --map (tasks)"
cmp $W/map.txt $W/map-tasks.txt || { diff $W/map.txt $W/map-tasks.txt; fail "the tasks path maps differently"; }
timeout 120 qemu-img convert -f raw -O raw "$URI" $W/convert2.img || fail "qemu-img convert (tasks)"
cmp $W/convert2.img $IMG || fail "qemu-img convert (tasks): contents differ"
echo "BLOCK STATUS TASKS PATH OK"
