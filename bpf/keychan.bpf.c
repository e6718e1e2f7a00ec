// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* lifl's in-kernel key channel: an SK_MSG verdict on a sockhash of the node's aggregator
 * sockets (TCP, keyed by instance id). Each send() of one 64-byte struct keymsg is redirected
 * into the destination socket's receive queue (BPF_F_INGRESS): nothing crosses TCP.
 *
 * The verdict never returns SK_DROP: a dropped message leaves the sending socket failing with
 * EACCES for good. A message it will not redirect (no route, another tenant, not one record)
 * gets SK_PASS and travels the sender's real TCP connection to its peer, the node's fallback
 * listener, which decides what to do with it; `passed` counts why.
 *
 * The sender's tenant comes from `senders` (storage on the sending socket, written when the
 * socket was registered), so a message's tenant field is checked, never trusted.
 *
 * lifl/keys/ebpf.py loads this object, pins the maps and fills them; it mirrors the limits below. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#include "keymsg.h"

/* Instances (and so sockets and senders) one node's channel holds. */
#define MAX_INSTANCES 4096
/* Messages redirected to one destination and not yet acknowledged by it: the kernel gives no
 * backpressure on redirected messages, so past this they travel TCP to the agent, which holds
 * a bounded number and then stops reading (TCP's own flow control stops the sender). */
#define MAX_OUTSTANDING 256

/* Why a message was passed to TCP instead of redirected: the `passed` map's index. */
enum pass_reason {
    PASS_NOT_A_RECORD = 0, /* the send was not exactly one 64-byte record */
    PASS_UNKNOWN_SENDER = 1, /* the sending socket was never registered */
    PASS_TENANT = 2,        /* sender, record and destination tenants differ */
    PASS_NO_ROUTE = 3,      /* the destination is not (or no longer) in `instances` */
    PASS_FULL = 4,          /* the destination has MAX_OUTSTANDING unacknowledged messages */
    PASS_ACK = 5,           /* an acknowledgement: credits given back, then on to the agent */
    PASS_REASONS = 6,
};

/* Per destination, summed over CPUs by the loader. */
struct dest_stats {
    __u64 messages;
    __u64 bytes;
    __u64 agg_us; /* sum of the agg_us the senders reported */
};

struct {
    __uint(type, BPF_MAP_TYPE_SOCKHASH);
    __uint(max_entries, MAX_INSTANCES);
    __type(key, __u32);   /* instance id */
    __type(value, __u64); /* the socket (an fd on update, its cookie on lookup) */
} instances SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, MAX_INSTANCES);
    __type(key, __u32);   /* instance id */
    __type(value, __u32); /* tenant id */
} tenants SEC(".maps");

/* Who a sending socket is, stored on the socket itself: SK_MSG programs may not call
 * bpf_get_socket_cookie (so no cookie-keyed hash), but may read socket storage; user space
 * writes it keyed by the socket's fd, and it goes away with the socket. */
struct sender {
    __u32 tenant;
    __u32 instance; /* whose credits its acknowledgements give back */
};

struct {
    __uint(type, BPF_MAP_TYPE_SK_STORAGE);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, int); /* a socket fd, from user space */
    __type(value, struct sender);
} senders SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, MAX_INSTANCES);
    __type(key, __u32);   /* destination instance id (registered with it) */
    __type(value, __u64); /* messages redirected to it and not acknowledged */
} outstanding SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_HASH);
    __uint(max_entries, MAX_INSTANCES);
    __type(key, __u32); /* destination instance id */
    __type(value, struct dest_stats);
} stats SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, PASS_REASONS);
    __type(key, __u32); /* enum pass_reason */
    __type(value, __u64);
} passed SEC(".maps");

static __always_inline int pass(__u32 reason)
{
    __u64 *count = bpf_map_lookup_elem(&passed, &reason);

    if (count)
        *count += 1; /* per CPU: no atomics needed */
    return SK_PASS;
}

static __always_inline void count_delivery(__u32 dest, __u32 agg_us)
{
    struct dest_stats *entry = bpf_map_lookup_elem(&stats, &dest);

    if (!entry) {
        struct dest_stats zero = {};

        /* BPF_NOEXIST: another CPU may have created it; a full map just goes uncounted */
        bpf_map_update_elem(&stats, &dest, &zero, BPF_NOEXIST);
        entry = bpf_map_lookup_elem(&stats, &dest);
        if (!entry)
            return;
    }
    entry->messages += 1;
    entry->bytes += KEYMSG_BYTES;
    entry->agg_us += agg_us;
}

SEC("sk_msg")
int lifl_keychan(struct sk_msg_md *msg)
{
    /* one verdict covers the whole send(): redirect only a send that is exactly one record */
    if (msg->size != KEYMSG_BYTES)
        return pass(PASS_NOT_A_RECORD);
    /* the record may straddle two pages of the send's scatterlist: make it linear (a no-op
     * when it already is; unconditional, as the verifier rejects a ctx load clang hoists) */
    if (bpf_msg_pull_data(msg, 0, KEYMSG_BYTES, 0) != 0)
        return pass(PASS_NOT_A_RECORD);

    void *data = msg->data;
    void *data_end = msg->data_end;
    if (data + KEYMSG_BYTES > data_end)
        return pass(PASS_NOT_A_RECORD);
    struct keymsg *record = data;
    __u32 dest = record->dest;
    __u32 claimed_tenant = record->tenant;
    __u32 agg_us = record->agg_us;

    __u16 kind = record->kind;
    __u32 count = record->count;

    struct bpf_sock *sk = msg->sk;
    if (!sk)
        return pass(PASS_UNKNOWN_SENDER);
    struct sender *sender = bpf_sk_storage_get(&senders, sk, NULL, 0);
    if (!sender)
        return pass(PASS_UNKNOWN_SENDER);
    if (kind == KEYMSG_KIND_ACK) {
        /* the sender's own credits only: whose they are comes from its socket, not the record */
        __u32 self = sender->instance;
        __u64 *owed = bpf_map_lookup_elem(&outstanding, &self);
        if (owed) {
            __u64 now = *owed;
            __sync_fetch_and_add(owed, -(__s64)(count < now ? count : now));
        }
        return pass(PASS_ACK); /* on to the agent, which sends what it held for this instance */
    }
    __u32 *dest_tenant = bpf_map_lookup_elem(&tenants, &dest);
    if (!dest_tenant)
        return pass(PASS_NO_ROUTE);
    if (sender->tenant != claimed_tenant || *dest_tenant != claimed_tenant)
        return pass(PASS_TENANT);
    __u64 *owed = bpf_map_lookup_elem(&outstanding, &dest);
    if (!owed)
        return pass(PASS_NO_ROUTE);
    if (*owed >= MAX_OUTSTANDING)
        return pass(PASS_FULL);

    /* SK_DROP from the helper means "no such socket" (it closed, or was never there): the
     * redirect was not set up, so our SK_PASS sends the message the TCP way */
    if (bpf_msg_redirect_hash(msg, &instances, &dest, BPF_F_INGRESS) != SK_PASS)
        return pass(PASS_NO_ROUTE);
    __sync_fetch_and_add(owed, 1);
    count_delivery(dest, agg_us);
    return SK_PASS;
}

/* GPL-compatible: the kernel offers some helpers to GPL programs only */
char LICENSE[] SEC("license") = "Dual BSD/GPL";
