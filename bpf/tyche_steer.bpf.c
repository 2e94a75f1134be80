// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Tyche XDP steering program.
 *
 * Frames with the Tyche EtherType and a well-formed Tyche common header (long enough, protocol
 * version this build speaks) are redirected into the AF_XDP socket registered in `xsks_map`
 * under the receive queue they arrived on. Everything else -- IP, ARP, and Tyche frames that no
 * socket is bound for -- goes on to the kernel stack (XDP_PASS), so Tyche co-exists with IP on
 * the same link.
 *
 * Two entry points share the maps: `tyche_steer` (SEC "xdp", single-buffer links) and
 * `tyche_steer_frags` (SEC "xdp.frags", loaded with BPF_F_XDP_HAS_FRAGS for multi-buffer /
 * jumbo links). Both only read the linear part of the first buffer, which always holds the
 * Ethernet and Tyche headers.
 *
 * Header offsets come from tyche_wire.h, generated from the Rust wire crate
 * (`cargo xtask gen-bpf-header`; CI runs it with `--check`).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "tyche_wire.h"

/* One AF_XDP socket per receive queue. */
struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, __u32);
} xsks_map SEC(".maps");

/* Slot 0: the EtherType to match, host order; 0 means TYCHE_DEFAULT_ETHERTYPE. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} tyche_config SEC(".maps");

/*
 * Nonces (host order) of DISCOVERs sent by a `tyche-init discover` through an AF_PACKET socket
 * beside a live AF_XDP socket on the same queue: their DISCOVER_REPLYs go on to the kernel
 * (XDP_PASS), where that socket reads them, instead of into the live socket. LRU, so the entry of
 * a killed discover ages out.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u32);
} tyche_discover SEC(".maps");

/* Per-CPU counters, indexed by the TYCHE_STAT_* values below. */
#define TYCHE_STAT_STEERED 0 /* Tyche frames handed to bpf_redirect_map */
#define TYCHE_STAT_MALFORMED 1 /* Tyche EtherType, but short header or foreign version */
#define TYCHE_STAT_PASSED 2 /* other traffic, left to the kernel */
#define TYCHE_STAT_COUNT 3

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, TYCHE_STAT_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} tyche_stats SEC(".maps");

static __always_inline void count(__u32 stat)
{
	__u64 *v = bpf_map_lookup_elem(&tyche_stats, &stat);

	if (v)
		*v += 1;
}

static __always_inline int steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u32 zero = 0;
	__u32 ethertype = TYCHE_DEFAULT_ETHERTYPE;
	__u32 *configured;
	__u8 *tyche;

	if ((void *)(eth + 1) > data_end) {
		count(TYCHE_STAT_PASSED);
		return XDP_PASS;
	}
	configured = bpf_map_lookup_elem(&tyche_config, &zero);
	if (configured && *configured)
		ethertype = *configured;
	if (eth->h_proto != bpf_htons((__u16)ethertype)) {
		count(TYCHE_STAT_PASSED);
		return XDP_PASS;
	}

	tyche = (__u8 *)data + TYCHE_ETH_HEADER_LEN;
	if ((void *)(tyche + TYCHE_COMMON_END) > data_end ||
	    tyche[TYCHE_COMMON_VERSION] != TYCHE_VERSION) {
		/* Nothing in the kernel handles this EtherType: it will be dropped there, counted. */
		count(TYCHE_STAT_MALFORMED);
		return XDP_PASS;
	}

	if (tyche[TYCHE_COMMON_KIND] == TYCHE_KIND_DISCOVER_REPLY &&
	    (void *)(tyche + TYCHE_DISCOVER_REPLY_NONCE + 4) <= data_end) {
		__u32 nonce;

		__builtin_memcpy(&nonce, tyche + TYCHE_DISCOVER_REPLY_NONCE, 4);
		nonce = bpf_ntohl(nonce);
		if (bpf_map_lookup_elem(&tyche_discover, &nonce)) {
			/* A reply to a discover reading through the kernel (AF_PACKET). */
			count(TYCHE_STAT_PASSED);
			return XDP_PASS;
		}
	}

	count(TYCHE_STAT_STEERED);
	/* No socket on this queue: XDP_PASS (the kernel drops it, IP is untouched either way). */
	return bpf_redirect_map(&xsks_map, ctx->rx_queue_index, XDP_PASS);
}

SEC("xdp")
int tyche_steer(struct xdp_md *ctx)
{
	return steer(ctx);
}

SEC("xdp.frags")
int tyche_steer_frags(struct xdp_md *ctx)
{
	return steer(ctx);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
