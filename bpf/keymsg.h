/* One key message: what aggregators pass instead of model bytes (64 bytes, little-endian).
 *
 * The one definition of the record: lifl/keys/record.py packs and unpacks the same layout, and
 * tests/test_channel.py pins its offsets to these, compiled. The destination comes first so an
 * SK_MSG verdict routes on the first 4 bytes; the tenant is the sender's, which the verdict
 * checks against the destination's before it redirects. */
#ifndef LIFL_KEYMSG_H
#define LIFL_KEYMSG_H

#define KEYMSG_BYTES 64
#define KEYMSG_KIND_KEY 1   /* an object to aggregate */
#define KEYMSG_KIND_CLOSE 2 /* no more inputs: finish with what arrived (count: the new fan-in) */
#define KEYMSG_KIND_ACK 3   /* the sender consumed `count` messages: its credits (eBPF flow control) */
#define KEYMSG_KIND_PREPARE 4 /* a hint: a KIND_KEY naming this object follows once it is written */
#define KEYMSG_FLAG_PARTIAL 1 /* the object holds a partial sum, not a client update */

struct keymsg {
    __u32 dest;    /* destination instance id */
    __u32 src;     /* sending instance id (0: the agent) */
    __u16 kind;    /* KEYMSG_KIND_* */
    __u16 flags;   /* KEYMSG_FLAG_* */
    __u32 count;   /* client updates it stands for (close: the new fan-in) */
    __u64 task;    /* the destination task the message is for */
    __u64 samples; /* client samples the object stands for */
    __u64 sent_ns; /* CLOCK_MONOTONIC at send: hand-off latency */
    __u8 key[16];  /* the object's key in shared memory */
    __u32 tenant;  /* the sender's tenant id: must be the destination's */
    __u32 agg_us;  /* aggregation time the sender reports (metrics) */
};

_Static_assert(sizeof(struct keymsg) == KEYMSG_BYTES, "a key message is 64 bytes");

#endif
