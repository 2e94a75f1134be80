#!/bin/bash
# AF_XDP end to end: two network namespaces made here joined by two veth pairs, the hidden
# `tyche-init ram-target` (a RAM export; or `tyched serve` when TYCHED=path) in one,
# `tyche-init serve-nbd` in the other, then
# nbdinfo and nbdcopy through the NBD socket, and a link taken down mid-copy. Root only.
# QUEUES=2 (with TYCHED): veth pairs with two queues each, both daemons with
# --channels-per-nic 2, so every channel has an AF_XDP socket and a queue of its own on both
# sides; checks that each of tyched's four sockets received frames.
# STEER=queue-mac-no-rules (with QUEUES=2 and TYCHED): tyched names a queue address per socket
# in ACCEPT; checks that `--steer queue-mac` (ntuple rules) is refused on veth with a clear
# error and leaves no address behind, and that every initiator channel sends to the queue
# address of the target socket serving it.
# MTU=9000 (with TYCHED): jumbo links, where every DATA frame is a multi-buffer AF_XDP frame
# over three UMEM chunks; fio writes and reads back (verified) 128 KiB blocks through the NBD
# socket, and tyched's payload_copied_bytes must not grow meanwhile (ZERO_COPY=1: the same
# check at any MTU).
# Run: BIN=target/debug/tyche-init bash crates/tyche-init/tests/xdp-veth-nbd.sh
set -u
QUEUES=${QUEUES:-1}
STEER=${STEER:-none}
MTU=${MTU:-3000}
VQ=""; [ "$QUEUES" -gt 1 ] && VQ="numtxqueues $QUEUES numrxqueues $QUEUES"
BIN=${BIN:?path of the tyche-init binary}
W=$(mktemp -d /tmp/tyxdp.XXXX)
NI=tyi$$; NT=tyt$$
TPID=""; IPID=""
cleanup() {
  [ -n "$IPID" ] && kill $IPID 2>/dev/null
  [ -n "$TPID" ] && kill $TPID 2>/dev/null
  wait 2>/dev/null
  ip netns del $NI 2>/dev/null; ip netns del $NT 2>/dev/null
  rm -rf $W
}
trap cleanup EXIT
ip netns add $NI && ip netns add $NT || exit 1
for k in 0 1; do
  ip link add ti$k netns $NI $VQ type veth peer name tt$k netns $NT $VQ || exit 1
  ip -n $NI link set ti$k mtu $MTU up; ip -n $NT link set tt$k mtu $MTU up
done
export TYCHE_INIT_STATE_DIR=$W/state TYCHE_LOG=${TYCHE_LOG:-info}
M0=$(ip -n $NT -o link show tt0 | grep -o 'link/ether [0-9a-f:]*' | cut -d' ' -f2)
M1=$(ip -n $NT -o link show tt1 | grep -o 'link/ether [0-9a-f:]*' | cut -d' ' -f2)
if [ -n "${TYCHED:-}" ] && [ "$STEER" != none ]; then
  # Flow rules on veth: no ntuple filters, so the start fails naming the step (listing the
  # rules, before anything is changed), and no queue address is left on the NIC.
  timeout 30 ip netns exec $NT $TYCHED serve --iface tt0 --export r=ram:1M --channels-per-nic $QUEUES \
    --steer queue-mac --stats-socket $W/refused.stats >/dev/null 2>$W/refused.log
  RC=$?
  sed 's/\x1b\[[0-9;]*m//g' $W/refused.log | grep -m1 "ethtool -n tt0" | tee $W/refused.err
  # Queue 0's address derived from tt0's: the first byte's upper six bits XOR 1, locally administered.
  Q0=$(python3 -c "import sys; b=bytes.fromhex(sys.argv[1].replace(':','')); print(':'.join(f'{x:02x}' for x in bytes([((((b[0]>>2)^1)&0x3f)<<2)|2])+b[1:]))" $M0)
  if [ $RC -ne 0 ] && grep -q "queue-mac-no-rules" $W/refused.err \
    && ! ip netns exec $NT bridge fdb show dev tt0 self | grep -q "$Q0"; then
    echo "XDP STEER RULES REFUSED ON VETH OK"
  else
    echo "rc $RC"; cat $W/refused.log; ip netns exec $NT bridge fdb show dev tt0 self
  fi
fi
if [ -n "${TYCHED:-}" ]; then
  # The real target daemon instead of the in-process RAM target.
  timeout 300 ip netns exec $NT $TYCHED serve --iface tt0 --iface tt1 --export ram=ram:64M \
    --channels-per-nic $QUEUES --steer $STEER --stats-socket $W/tyched.stats >$W/target.out 2>$W/target.log & TPID=$!
  echo "target: tyched"
else
  timeout 300 ip netns exec $NT $BIN ram-target --iface tt0 --iface tt1 --export ram --mib 64 >$W/target.out 2>$W/target.log & TPID=$!
  echo "target: tyche-init ram-target"
fi
sleep 1
[ -n "$M0" ] && [ -n "$M1" ] && kill -0 $TPID || { echo "target did not start"; cat $W/target.log; exit 1; }
timeout 30 ip netns exec $NI $BIN discover --iface ti0 --iface ti1 --wait 0.5 2>/dev/null | tee $W/discover.out
grep -q "ram" $W/discover.out && echo "XDP DISCOVER OK"
SOCK=$W/nbd.sock
# FIND_TARGET=1: no --target, the initiator finds the target by discovery.
TARGETS="--target $M0 --target $M1"; [ -n "${FIND_TARGET:-}" ] && TARGETS=""
timeout 300 ip netns exec $NI $BIN serve-nbd --socket $SOCK --iface ti0 --iface ti1 $TARGETS \
  --export ram --channels-per-nic 2 --no-path-timeout 10 --stats-socket $W/init.stats.sock >$W/init.out 2>$W/init.log & IPID=$!
for i in $(seq 100); do [ -S $SOCK ] && break; sleep 0.1; done
[ -S $SOCK ] || { echo "initiator did not start"; cat $W/init.log; exit 1; }
timeout 30 nbdinfo "nbd+unix:///ram?socket=$SOCK" | grep -E "export-size|can_multi_conn" || exit 1
head -c 48M /dev/urandom > $W/in
timeout 120 nbdcopy $W/in "nbd+unix:///ram?socket=$SOCK" || { echo "nbdcopy in failed"; tail $W/init.log; exit 1; }
timeout 120 nbdcopy "nbd+unix:///ram?socket=$SOCK" $W/out || exit 1
cmp <(head -c 48M $W/out) $W/in && echo "XDP NBDCOPY ROUND TRIP OK"
if { [ "$MTU" -gt 3632 ] || [ -n "${ZERO_COPY:-}" ]; } && [ -n "${TYCHED:-}" ]; then
  # 128 KiB blocks written and read back (verified) by fio: not one payload byte of them copied
  # on the target. (The counters before and after: nbdcopy above also asked for BLOCK_STATUS,
  # whose extent lists are made in slot memory and sent from there, counted as copies.)
  $TYCHED stats --socket $W/tyched.stats --json > $W/before.json
  timeout 120 fio --name=jumbo --ioengine=nbd --uri="nbd+unix:///ram?socket=$SOCK" --rw=write --bs=128k \
    --size=16M --iodepth=8 --verify=crc32c --do_verify=1 --verify_state_save=0 > $W/fio.out 2>&1 \
    && grep -q "err= 0" $W/fio.out && ! grep -q "verify:" $W/fio.out && echo "XDP FIO 128K VERIFY OK" \
    || { echo "fio at MTU $MTU failed"; cat $W/fio.out; }
  $TYCHED stats --socket $W/tyched.stats --json > $W/after.json
  python3 - $W/before.json $W/after.json $MTU <<'PY' && echo "XDP FIO 128K ZERO COPY OK"
import json, sys
b, a = (json.load(open(f)) for f in sys.argv[1:3])
d = lambda f: f(a) - f(b)
copied = d(lambda s: s["payload_copied_bytes"])
kept = d(lambda s: sum(n["frames_kept"] for n in s["nics"]))
in_place = d(lambda s: sum(n["frames_sent_in_place"] for n in s["nics"]))
print(f"MTU {sys.argv[3]}, fio 128 KiB write+verify: payload_copied_bytes +{copied} (total {a['payload_copied_bytes']}),"
      f" frames kept +{kept}, sent in place +{in_place}")
sys.exit(0 if copied == 0 and kept > 0 and in_place > 0 else 1)
PY
fi
if [ "$QUEUES" -gt 1 ] && [ -n "${TYCHED:-}" ]; then
  # Every queue's socket on the target received frames: each channel has a queue of its own.
  $TYCHED stats --socket $W/tyched.stats --json > $W/stats.json
  python3 - $W/stats.json $QUEUES <<'PY' && echo "XDP QUEUES OK"
import json, sys
s = json.load(open(sys.argv[1])); q = int(sys.argv[2])
rx = {n["name"]: n["frames_rx"] for n in s["nics"]}
want = [f"tt{k}/{i}" for k in range(2) for i in range(q)]
print("frames received per target socket:", {w: rx.get(w) for w in want})
sys.exit(0 if all(rx.get(w, 0) > 0 for w in want) else 1)
PY
fi
if [ "$STEER" != none ] && [ -n "${TYCHED:-}" ]; then
  # Each target socket tt<k>/<q> has the queue address derived from tt<k>'s MAC; every channel
  # of the initiator sends to the queue address of the socket that serves it on the target,
  # and the four addresses are all in use.
  $TYCHED stats --socket $W/tyched.stats --json > $W/stats.json
  $BIN stats $W/init.stats.sock --json > $W/init.json
  python3 - $W/stats.json $W/init.json $QUEUES $M0 $M1 <<'PY' && echo "XDP STEER QUEUE ADDRESSES OK"
import json, sys
t = json.load(open(sys.argv[1])); i = json.load(open(sys.argv[2])); q = int(sys.argv[3]); macs = sys.argv[4:6]
def derive(mac, n):
    b = bytes.fromhex(mac.replace(":", ""))
    b0 = ((((b[0] >> 2) ^ (n + 1)) & 0x3f) << 2) | 2
    return ":".join(f"{x:02x}" for x in bytes([b0]) + b[1:])
addr = {f"tt{k}/{n}": derive(macs[k], n) for k in range(2) for n in range(q)}
# The target's channels: session, channel index -> the socket serving it.
served = {(c["session"], c["channel"]): c["nic"] for c in t["channels"] if not c["dead"]}
named = {(i["session"], c["channel"]): c["target"] for c in i["channels"] if c["live"]}
print("target socket and queue address per channel:",
      {k: (served.get(k), v) for k, v in named.items()})
ok = named and all(served.get(k) and addr[served[k]] == v for k, v in named.items())
ok = ok and set(named.values()) == set(addr.values())
# The target's end of each channel sends from its socket's queue address.
ok = ok and all(addr[c["nic"]] == c["addr"] for c in t["channels"] if not c["dead"])
sys.exit(0 if ok else 1)
PY
fi
# Fail one link while copying: everything still lands, through the other.
( sleep 0.3; ip -n $NI link set ti1 down ) &
timeout 120 nbdcopy $W/in "nbd+unix:///ram?socket=$SOCK" || { echo "nbdcopy during failover failed"; tail $W/init.log; exit 1; }
rm -f $W/out; timeout 120 nbdcopy "nbd+unix:///ram?socket=$SOCK" $W/out || exit 1
cmp <(head -c 48M $W/out) $W/in && echo "XDP FAILOVER ROUND TRIP OK"
grep -E "dead|reconnect" $W/init.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
