#!/bin/bash
# TCP baseline against the real target daemon, inside a network namespace made here (loopback
# only): `tyched serve --transport tcp` and `tyche-init serve-nbd --tcp` (target found by
# discovery; keyed export: the initiator proves the pre-shared key), nbdcopy round trip.
# Root only. Run: TYCHED=path BIN=path bash tcp-tyched.sh
set -u
BIN=${BIN:?path of the tyche-init binary}; TYCHED=${TYCHED:?path of the tyched binary}
W=$(mktemp -d /tmp/tytcp.XXXX); NS=tytcp$$; TPID=""; IPID=""
cleanup() {
  [ -n "$IPID" ] && kill $IPID 2>/dev/null; [ -n "$TPID" ] && kill $TPID 2>/dev/null
  wait 2>/dev/null; ip netns del $NS 2>/dev/null; rm -rf $W
}
trap cleanup EXIT
ip netns add $NS && ip -n $NS link set lo up || exit 1
export TYCHE_INIT_STATE_DIR=$W/state
# The export needs a pre-shared key: the initiator proves it with --key.
cat >$W/tyched.toml <<EOT
ifaces = ["lo", "lo"]
transport = "tcp"
tcp_listen = "127.0.0.1:7788"

[[export]]
name = "ram"
size = "64M"
key_file = "$W/key"
EOT
# Key files are refused when their group or others may read them.
printf 'sixteen bytes or more of key\n' >$W/key
chmod 600 $W/key
timeout 300 ip netns exec $NS $TYCHED serve --config $W/tyched.toml >$W/target.out 2>$W/target.log & TPID=$!
sleep 1
SOCK=$W/nbd.sock
timeout 300 ip netns exec $NS $BIN serve-nbd --socket $SOCK --tcp 127.0.0.1:7788 --tcp 127.0.0.1:7788 --export ram --key $W/key \
  >$W/init.out 2>$W/init.log & IPID=$!
for i in $(seq 100); do [ -S $SOCK ] && break; sleep 0.1; done
[ -S $SOCK ] || { echo "initiator did not start"; cat $W/init.log $W/target.log; exit 1; }
head -c 32M /dev/urandom > $W/in
timeout 120 nbdcopy $W/in "nbd+unix:///ram?socket=$SOCK" || { tail $W/init.log; exit 1; }
timeout 120 nbdcopy "nbd+unix:///ram?socket=$SOCK" $W/out || exit 1
cmp <(head -c 32M $W/out) $W/in && echo "TCP NBDCOPY ROUND TRIP OK"
