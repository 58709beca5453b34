/* The columns of a Flight Recorder dump straight from its pickle's bytes (contract/torch_fr_dumps.py).

    python -m distcheck report dumps/     # every pickle dump goes through scan() where this module is built

A 20,000-entry dump unpickles in about 0.2 s (every entry a dict, every frame a dict); 4,096 of them would take
minutes. scan() runs the pickle's opcodes without making a Python object per value, at three speeds:

* the general loop (run): each value on its stack is a small struct with a structural 64-bit hash and the byte
  range of the opcodes that made it; an entry (a dict with one of an entry's keys) fills one row of the columns as
  its SETITEMS runs: its numbers are stored, each repeating value (op name, state, group, frames, sizes, dtypes)
  becomes an index into a per-column table of distinct values, keyed by the hash (two different values with one
  64-bit hash are taken as one: odds of about 2^-64 per pair);
* try_entry(): an entry's pairs read straight into its row, no Val per key or number (the same values, hashes
  and ids; it gives up on anything outside a dump's usual grammar, and the general loop reads that entry);
* try_plan(): an entry whose bytes are those of an earlier entry of its kind but for its numbers (the usual case
  in torch's dumps, where keys, op names, states, groups and frames are memo fetches) is read from the earlier
  one's plan: a few memcmp()s, then the numbers.

Each row also gets its combination (op, group, sizes, dtypes: a ring has a few dozen), so the analysis works per
combination. Only the distinct values, the combinations and the document's other keys (version, pg_config,
pg_status) are made into Python objects at the end, the values by running the opcodes of their byte ranges again.

The scan lets go of the GIL (the reader's threads scan several files at once). A pickle cut off mid-way keeps
the rows of the entries completed before the cut, and the other keys when they came first (torch writes them
before the entries). What this scanner does not support (a protocol-0 opcode, an integer wider than 64 bits) is
an error "unsupported": the caller then loads the file whole. What no dump holds (a global, a reduce, a
persistent id) is an error "invalid": the caller refuses the file, as the restricted unpickler does. Every read is
bounds-checked against the buffer. scan(buffer, fast=False) leaves the two fast paths out (the tests compare).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { V_MARK = 1, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_BYTES, V_LIST, V_DICT, V_TUPLE };

/* Field codes of an entry's keys: 1-9 numbers, 10-11 flags, 12-19 repeating values, 20 the top dict's entries. */
#define N_INT 9
#define N_FLAG 2
#define N_VALUE 8
#define F_FIRST_FLAG 10
#define F_FIRST_VALUE 12
#define F_ENTRIES 20
static const char *FIELD_NAMES[] = {
    NULL, "record_id", "pg_id", "collective_seq_id", "p2p_seq_id", "op_id", "time_created_ns",
    "time_discovered_started_ns", "time_discovered_completed_ns", "timeout_ms", "retired", "is_p2p",
    "profiling_name", "state", "process_group", "frames", "input_sizes", "output_sizes", "input_dtypes",
    "output_dtypes", "entries"};
#define N_FIELDS 21
static const int64_t INT_DEFAULT[N_INT] = {-1, -1, -1, -1, -1, 0, 0, 0, 0};

typedef struct {
    uint8_t type;
    uint8_t field;  /* V_STR: the field code this string names (0: none) */
    uint8_t top;    /* V_DICT: the document's own dict */
    uint8_t hashed; /* scalars are hashed when first needed (most never are: an entry's numbers, its keys) */
    int32_t row;    /* V_DICT: the entry row it fills (-1: not an entry) */
    int32_t memo;   /* containers: the scalars slot its memoized copy is in (-1: none), kept up to date */
    uint32_t len;   /* V_STR/V_BYTES: the byte length */
    int64_t ival;   /* V_INT/V_BOOL: the value; V_STR/V_BYTES: the offset of the bytes; containers: items */
    uint64_t hash;
    uint32_t start, end; /* the opcodes that made it: buf[start:end] (a dump is far below 4 GB: scan() checks) */
} Val;

typedef struct {
    size_t sp;
    uint64_t off;
} Mark;

typedef struct {
    uint64_t *keys;
    int32_t *ids;
    uint64_t *starts, *ends;
    size_t cap, n, ncap;
} Intern;

/* An entry's bytes as a template: what try_plan() checks a later entry against (see try_plan). */
#define NPLANS 32
#define PLAN_MAX 4096  /* longest entry (bytes) kept as a plan */
#define PLAN_HOLES 24
typedef struct {
    uint16_t off;   /* where the number's payload starts, from the entry's first byte */
    uint8_t width;  /* its bytes */
    uint8_t opcode; /* K, M, J or LONG1 (signedness), G (a float: skipped) */
    int8_t col;     /* 0-8: an int column, 9-10: a flag column, -1: a field no column keeps */
} Hole;
typedef struct {
    int8_t kind;    /* 1: a flag column, 2: a value column's id, 3: the row's combination */
    int8_t col;
    int32_t value;
} Const;
typedef struct {
    uint8_t *bytes;
    uint32_t len;
    uint16_t nholes, nconsts, nruns;
    Hole holes[PLAN_HOLES];
    Const consts[N_FIELDS + 1];
    struct { uint16_t off, len; } runs[PLAN_HOLES + 1];
    int next; /* the plan the entry after this one matched last time (-1: none) */
} Plan;

typedef struct {
    const uint8_t *buf;
    size_t size, pos;
    Val *stack;
    size_t sp, stack_cap;
    Mark *marks;
    size_t nmarks, marks_cap;
    int32_t *memo; /* memo id -> index into scalars (-1: unset) */
    size_t memo_cap, memo_next;
    Val *scalars;
    size_t nscalars, scalars_cap;
    /* the columns */
    int64_t *ints[N_INT];
    int8_t *flags[N_FLAG];
    int32_t *ids[N_VALUE];
    int32_t *combo; /* each row's combination of op, group, sizes and dtypes (an index into combos) */
    size_t rows, rows_cap;
    Intern tables[N_VALUE];
    /* the distinct combinations: COMBO_IDS ids each (a ring holds a few dozen); open addressing on their hash */
    int32_t *combos;
    size_t ncombos, combos_cap;
    int32_t *combo_slots;
    size_t combo_slots_cap;
    /* the top dict's other keys: (key, value) pairs, decoded at the end */
    Val *meta;
    size_t nmeta, meta_cap;
    int truncated, stopped;
    int top_dict, has_entries; /* the document is a dict; it has an "entries" key */
    int fast; /* try_entry() for entries (scan(fast=False): the general loop alone, to compare) */
    Plan plans[NPLANS];
    int nplans, last_plan, plan_victim;
    const char *error;    /* static text */
    int unsupported;      /* 1: a limitation of this scanner (the caller loads the file whole) */
    char errbuf[160];
} Scan;

/* --- hashing ---------------------------------------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

static uint64_t hash_bytes(const uint8_t *p, size_t n, uint64_t seed) {
    uint64_t h = seed ^ (n * 0x9E3779B97F4A7C15ULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = mix64(h ^ w);
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    return mix64(h ^ w ^ 0xA5);
}

static inline uint64_t combine(uint64_t h, uint64_t item) { return mix64(h + item * 0x9E3779B97F4A7C15ULL + 1); }

/* The structural hash of a value: containers keep theirs up to date as items arrive; scalars get theirs here. */
static inline uint64_t vhash(const uint8_t *buf, Val *v) {
    if (!v->hashed) {
        switch (v->type) {
        case V_STR: v->hash = hash_bytes(buf + v->ival, v->len, 0x5354ULL); break;
        case V_BYTES: v->hash = hash_bytes(buf + v->ival, v->len, 0x4259ULL); break;
        case V_BOOL: v->hash = mix64((uint64_t)v->ival ^ 0xB0B0ULL); break;
        case V_NONE: v->hash = mix64(0x4E4FULL); break;
        case V_FLOAT: v->hash = mix64((uint64_t)v->ival ^ 0xF107ULL); break;
        default: v->hash = mix64((uint64_t)v->ival ^ 0x1177ULL); break;
        }
        v->hashed = 1;
    }
    return v->hash;
}

/* --- growth ----------------------------------------------------------------------------------------------- */

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int fail(Scan *s, const char *why, int unsupported) {
    if (!s->error) {
        snprintf(s->errbuf, sizeof s->errbuf, "%s at byte %zu", why, s->pos);
        s->error = s->errbuf;
        s->unsupported = unsupported;
    }
    return -1;
}

static inline int push(Scan *s, const Val *v) {
    if (grow((void **)&s->stack, &s->stack_cap, s->sp + 1, sizeof(Val))) return fail(s, "out of memory", 0);
    s->stack[s->sp++] = *v;
    return 0;
}

/* A new value's slot on top of the stack, its fields set in place (a copy of a just-built local is a store the
   CPU cannot forward to the wide loads of the copy: that stall was a third of the scan). */
static inline Val *new_slot(Scan *s, uint8_t type, uint64_t start) {
    if (s->sp >= s->stack_cap && grow((void **)&s->stack, &s->stack_cap, s->sp + 1, sizeof(Val))) {
        fail(s, "out of memory", 0);
        return NULL;
    }
    Val *v = &s->stack[s->sp++];
    v->type = type;
    v->field = 0;
    v->top = 0;
    v->hashed = 0;
    v->row = -1;
    v->memo = -1;
    v->len = 0;
    v->ival = 0;
    v->hash = 0;
    v->start = (uint32_t)start;
    v->end = (uint32_t)s->pos;
    return v;
}

static int field_of(const uint8_t *p, size_t n) {
    for (int i = 1; i < N_FIELDS; i++)
        if (strlen(FIELD_NAMES[i]) == n && memcmp(FIELD_NAMES[i], p, n) == 0) return i;
    return 0;
}

/* --- interning and rows ----------------------------------------------------------------------------------- */

static int32_t intern_hash(Scan *s, Intern *t, uint64_t h, uint32_t start, uint32_t end);

static int32_t intern(Scan *s, Intern *t, Val *v) {
    return intern_hash(s, t, vhash(s->buf, v), v->start, v->end);
}

/* The id of the value with hash ``h`` in table ``t`` (new: its opcodes are buf[start:end]). */
static int32_t intern_hash(Scan *s, Intern *t, uint64_t h, uint32_t start, uint32_t end) {
    if (t->n * 2 >= t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 256;
        uint64_t *keys = calloc(cap, sizeof(uint64_t));
        int32_t *ids = malloc(cap * sizeof(int32_t));
        if (!keys || !ids) {
            free(keys);
            free(ids);
            fail(s, "out of memory", 0);
            return -1;
        }
        for (size_t i = 0; i < cap; i++) ids[i] = -1;
        for (size_t i = 0; i < t->cap; i++) {
            if (t->ids[i] < 0) continue;
            size_t j = t->keys[i] & (cap - 1);
            while (ids[j] >= 0) j = (j + 1) & (cap - 1);
            keys[j] = t->keys[i];
            ids[j] = t->ids[i];
        }
        free(t->keys);
        free(t->ids);
        t->keys = keys;
        t->ids = ids;
        t->cap = cap;
    }
    size_t j = h & (t->cap - 1);
    while (t->ids[j] >= 0) {
        if (t->keys[j] == h) return t->ids[j];
        j = (j + 1) & (t->cap - 1);
    }
    if (t->n >= t->ncap) {
        size_t cap = t->ncap ? t->ncap * 2 : 64;
        uint64_t *starts = realloc(t->starts, cap * sizeof(uint64_t));
        if (starts) t->starts = starts;
        uint64_t *ends = starts ? realloc(t->ends, cap * sizeof(uint64_t)) : NULL;
        if (!ends) {
            fail(s, "out of memory", 0);
            return -1;
        }
        t->ends = ends;
        t->ncap = cap;
    }
    t->starts[t->n] = start;
    t->ends[t->n] = end;
    t->keys[j] = h;
    t->ids[j] = (int32_t)t->n;
    return (int32_t)t->n++;
}

static int new_row(Scan *s) {
    if (s->rows >= s->rows_cap) {
        size_t cap = s->rows_cap ? s->rows_cap * 2 : 1024;
        for (int i = 0; i < N_INT; i++) {
            int64_t *p = realloc(s->ints[i], cap * sizeof(int64_t));
            if (!p) return fail(s, "out of memory", 0);
            s->ints[i] = p;
        }
        for (int i = 0; i < N_FLAG; i++) {
            int8_t *p = realloc(s->flags[i], cap);
            if (!p) return fail(s, "out of memory", 0);
            s->flags[i] = p;
        }
        for (int i = 0; i < N_VALUE; i++) {
            int32_t *p = realloc(s->ids[i], cap * sizeof(int32_t));
            if (!p) return fail(s, "out of memory", 0);
            s->ids[i] = p;
        }
        int32_t *c = realloc(s->combo, cap * sizeof(int32_t));
        if (!c) return fail(s, "out of memory", 0);
        s->combo = c;
        s->rows_cap = cap;
    }
    size_t r = s->rows++;
    for (int i = 0; i < N_INT; i++) s->ints[i][r] = INT_DEFAULT[i];
    for (int i = 0; i < N_FLAG; i++) s->flags[i][r] = -1;
    for (int i = 0; i < N_VALUE; i++) s->ids[i][r] = -1;
    s->combo[r] = -1;
    return (int)r;
}

/* The value columns a combination is made of: profiling_name, process_group, input/output sizes and dtypes. */
#define COMBO_IDS 6
static const int COMBO_COLS[COMBO_IDS] = {0, 2, 4, 5, 6, 7};

/* The row's combination id (interned), or -1 on no memory. */
static int32_t combo_of(Scan *s, size_t row) {
    int32_t key[COMBO_IDS];
    uint64_t h = 0xC0B0ULL;
    for (int i = 0; i < COMBO_IDS; i++) {
        key[i] = s->ids[COMBO_COLS[i]][row];
        h = combine(h, (uint64_t)(uint32_t)key[i]);
    }
    if (s->ncombos * 2 >= s->combo_slots_cap) {
        size_t cap = s->combo_slots_cap ? s->combo_slots_cap * 2 : 64;
        int32_t *slots = malloc(cap * sizeof(int32_t));
        if (!slots) return -1;
        for (size_t i = 0; i < cap; i++) slots[i] = -1;
        for (size_t c = 0; c < s->ncombos; c++) {
            uint64_t hc = 0xC0B0ULL;
            for (int i = 0; i < COMBO_IDS; i++) hc = combine(hc, (uint64_t)(uint32_t)s->combos[c * COMBO_IDS + i]);
            size_t j = hc & (cap - 1);
            while (slots[j] >= 0) j = (j + 1) & (cap - 1);
            slots[j] = (int32_t)c;
        }
        free(s->combo_slots);
        s->combo_slots = slots;
        s->combo_slots_cap = cap;
    }
    size_t j = h & (s->combo_slots_cap - 1);
    while (s->combo_slots[j] >= 0) {
        int32_t c = s->combo_slots[j];
        if (!memcmp(&s->combos[c * COMBO_IDS], key, sizeof key)) return c;
        j = (j + 1) & (s->combo_slots_cap - 1);
    }
    if (grow((void **)&s->combos, &s->combos_cap, (s->ncombos + 1) * COMBO_IDS, sizeof(int32_t))) return -1;
    memcpy(&s->combos[s->ncombos * COMBO_IDS], key, sizeof key);
    s->combo_slots[j] = (int32_t)s->ncombos;
    return (int32_t)s->ncombos++;
}

/* One (key, value) of an entry dict into its row. */
static int fill(Scan *s, int32_t row, const Val *k, Val *v) {
    int f = k->field;
    if (f <= 0 || f >= F_ENTRIES) return 0;
    if (f < F_FIRST_FLAG) {
        if (v->type == V_INT || v->type == V_BOOL) s->ints[f - 1][row] = v->ival;
    } else if (f < F_FIRST_VALUE) {
        if (v->type == V_INT || v->type == V_BOOL) s->flags[f - F_FIRST_FLAG][row] = v->ival != 0;
    } else {
        int32_t id = intern(s, &s->tables[f - F_FIRST_VALUE], v);
        if (id < 0) return -1;
        s->ids[f - F_FIRST_VALUE][row] = id;
    }
    return 0;
}

static int is_entry_key(int f) { return f == 1 || f == 3 || f == 12; }

/* Items stack[lo:hi] (pairs) into the dict at stack[lo - 1]. */
static int set_items(Scan *s, size_t lo, size_t hi) {
    if (lo == 0 || (hi - lo) % 2) return fail(s, "odd SETITEMS", 0);
    Val *d = &s->stack[lo - 1];
    if (d->type != V_DICT) return fail(s, "SETITEMS on a non-dict", 0);
    if (d->row < 0 && !d->top) {
        for (size_t i = lo; i < hi; i += 2)
            if (s->stack[i].type == V_STR && is_entry_key(s->stack[i].field)) {
                int r = new_row(s);
                if (r < 0) return -1;
                d = &s->stack[lo - 1];
                d->row = r;
                break;
            }
    }
    /* An entry's own dict and the document's are never values of a column: no hash for them. */
    int hashing = d->row < 0 && !d->top;
    for (size_t i = lo; i < hi; i += 2) {
        Val *k = &s->stack[i], *v = &s->stack[i + 1];
        if (hashing) d->hash = combine(d->hash, vhash(s->buf, k) * 31 + vhash(s->buf, v));
        if (d->row >= 0 && k->type == V_STR && fill(s, d->row, k, v)) return -1;
        if (d->top && k->type == V_STR && k->field == F_ENTRIES) s->has_entries = 1;
        if (d->top && !(k->type == V_STR && k->field == F_ENTRIES)) {
            if (grow((void **)&s->meta, &s->meta_cap, s->nmeta + 2, sizeof(Val))) return fail(s, "out of memory", 0);
            s->meta[s->nmeta++] = *k;
            s->meta[s->nmeta++] = *v;
        }
    }
    d->ival += (hi - lo) / 2;
    d->end = (uint32_t)s->pos;
    if (d->memo >= 0) s->scalars[d->memo] = *d;
    if (d->row >= 0 && (s->combo[d->row] = combo_of(s, (size_t)d->row)) < 0) return fail(s, "out of memory", 0);
    s->sp = lo;
    return 0;
}

static int append_items(Scan *s, size_t lo, size_t hi) {
    if (lo == 0) return fail(s, "APPENDS without a list", 0);
    Val *l = &s->stack[lo - 1];
    if (l->type != V_LIST) return fail(s, "APPENDS on a non-list", 0);
    for (size_t i = lo; i < hi; i++)
        if (s->stack[i].row < 0) l->hash = combine(l->hash, vhash(s->buf, &s->stack[i])); /* not the entries */
    l->ival += hi - lo;
    l->end = (uint32_t)s->pos;
    if (l->memo >= 0) s->scalars[l->memo] = *l;
    s->sp = lo;
    return 0;
}

static int make_tuple(Scan *s, size_t lo, uint64_t start) {
    uint64_t h = 0x7475706C65ULL;
    for (size_t i = lo; i < s->sp; i++) h = combine(h, vhash(s->buf, &s->stack[i]));
    int64_t n = (int64_t)(s->sp - lo);
    s->sp = lo;
    Val *t = new_slot(s, V_TUPLE, start);
    if (!t) return -1;
    t->hash = h;
    t->hashed = 1;
    t->ival = n;
    return 0;
}

/* --- the opcode loop (no Python API: runs without the GIL) -------------------------------------------------- */

#define NEED(n) do { if (s->size - s->pos < (size_t)(n)) { s->truncated = 1; return 1; } } while (0)
/* A helper's 0 (done), 1 (the bytes ended) or -1 (an error), passed on. */
#define TRY(x) do { int r_ = (x); if (r_) return r_; } while (0)

static uint64_t rd_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Memoize value ``v`` under ``id``; 0 or -1. */
static int memo_store(Scan *s, uint64_t id, Val *v) {
    if (id > ((uint64_t)1 << 28) || id > 8 * (uint64_t)s->size + 1024) return fail(s, "memo id out of range", 0);
    if (id >= s->memo_cap) {
        size_t old = s->memo_cap;
        if (grow((void **)&s->memo, &s->memo_cap, (size_t)id + 1, sizeof(int32_t))) return fail(s, "out of memory", 0);
        for (size_t i = old; i < s->memo_cap; i++) s->memo[i] = -1;
    }
    if (grow((void **)&s->scalars, &s->scalars_cap, s->nscalars + 1, sizeof(Val))) return fail(s, "out of memory", 0);
    /* torch's pickler memoizes a container once it is complete and fetches it again (an entry's frames are the
       frame dicts of earlier entries); Python's memoizes it empty and fills it after: the copy follows it. */
    if (v->type >= V_LIST && v->memo < 0) v->memo = (int32_t)s->nscalars;
    if (v->type < V_LIST) vhash(s->buf, v); /* once here, not at every GET of it */
    s->scalars[s->nscalars] = *v;
    s->memo[id] = (int32_t)s->nscalars++;
    if (id + 1 > s->memo_next) s->memo_next = id + 1;
    return 0;
}

static int memo_put(Scan *s, uint64_t id) {
    if (s->sp == 0) return fail(s, "PUT on an empty stack", 0);
    return memo_store(s, id, &s->stack[s->sp - 1]);
}

static int memo_get(Scan *s, uint64_t id, uint64_t start) {
    if (id >= s->memo_cap || s->memo[id] == -1) return fail(s, "GET of an unset memo id", 0);
    if (s->sp >= s->stack_cap && grow((void **)&s->stack, &s->stack_cap, s->sp + 1, sizeof(Val)))
        return fail(s, "out of memory", 0);
    Val *v = &s->stack[s->sp++];
    *v = s->scalars[s->memo[id]];
    v->start = (uint32_t)start;
    v->end = (uint32_t)s->pos;
    return 0;
}

static int scalar_str(Scan *s, uint64_t len, int type, uint64_t start) {
    NEED(len);
    Val *v = new_slot(s, (uint8_t)type, start);
    if (!v) return -1;
    v->ival = (int64_t)s->pos;
    v->len = (uint32_t)len;
    if (type == V_STR && len <= 40) v->field = (uint8_t)field_of(s->buf + s->pos, len);
    s->pos += len;
    v->end = (uint32_t)s->pos;
    return 0;
}

static inline int scalar_int(Scan *s, int64_t x, int type, uint64_t start) {
    Val *v = new_slot(s, (uint8_t)type, start);
    if (!v) return -1;
    v->ival = x;
    return 0;
}

static int container(Scan *s, int type, uint64_t start) {
    int top = type == V_DICT && s->sp == 0;
    Val *v = new_slot(s, (uint8_t)type, start);
    if (!v) return -1;
    v->hash = type == V_LIST ? 0x6C697374ULL : 0x64696374ULL;
    v->hashed = 1;
    v->top = (uint8_t)top;
    if (top) s->top_dict = 1;
    return 0;
}

static int pop_mark(Scan *s, size_t *lo, uint64_t *off) {
    if (!s->nmarks) return fail(s, "no MARK", 0);
    s->nmarks--;
    *lo = s->marks[s->nmarks].sp;
    if (off) *off = s->marks[s->nmarks].off;
    if (*lo > s->sp) return fail(s, "MARK above the stack", 0);
    return 0;
}

/* 0: STOP reached; 1: the bytes ended first (truncated); -1: an error (s->error says). */
/* --- the fast path for an entry ----------------------------------------------------------------------------

A ring's entries are almost all alike: a dict of about 20 memoized keys, each followed by a number, a memoized
string, a short list or a tuple of two strings. The general loop above pushes every key and value as a Val and
reads them back at SETITEMS; try_entry() reads one entry's pairs straight into its row instead (numbers into their
columns, repeating values hashed and interned as they are read), the same values with the same hashes. Anything it
does not expect (a tuple where none is usual, an opcode outside this small grammar, the end of the bytes) makes it
give up: the position, the row and the memo are as before (a memo put it did is done again, alike) and the general
loop reads the entry. */

#define FP_OK 0
#define FP_BAIL 1

static inline int fp_need(const Scan *s, size_t pos, size_t n) { return s->size - pos >= n; }

/* Memoize ``v`` for each memo opcode at ``*pos``. */
static int fp_memo(Scan *s, size_t *pos, Val *v) {
    while (*pos < s->size) {
        uint8_t op = s->buf[*pos];
        uint64_t id;
        if (op == 'q') {
            if (!fp_need(s, *pos, 2)) return FP_BAIL;
            id = s->buf[*pos + 1];
            *pos += 2;
        } else if (op == 'r') {
            if (!fp_need(s, *pos, 5)) return FP_BAIL;
            id = rd_le(s->buf + *pos + 1, 4);
            *pos += 5;
        } else if (op == 0x94) {
            id = s->memo_next;
            *pos += 1;
        } else {
            return FP_OK;
        }
        if (memo_store(s, id, v)) return FP_BAIL;
    }
    return FP_OK;
}

static inline void fp_init(Val *v, uint8_t type, size_t start) {
    v->type = type;
    v->field = 0;
    v->top = 0;
    v->hashed = 0;
    v->row = -1;
    v->memo = -1;
    v->len = 0;
    v->ival = 0;
    v->hash = 0;
    v->start = (uint32_t)start;
    v->end = (uint32_t)start;
}

static int fp_value(Scan *s, size_t *pos, Val *v, int depth);

/* A memo GET at *pos: its slot (hashed: memo_store hashes scalars, containers keep theirs), or NULL. */
static inline const Val *fp_get(Scan *s, size_t *pos) {
    size_t p = *pos;
    uint8_t op = s->buf[p];
    uint64_t id;
    if (op == 'h') {
        if (!fp_need(s, p, 2)) return NULL;
        id = s->buf[p + 1];
        p += 2;
    } else if (op == 'j') {
        if (!fp_need(s, p, 5)) return NULL;
        id = rd_le(s->buf + p + 1, 4);
        p += 5;
    } else {
        return NULL;
    }
    if (id >= s->memo_cap || s->memo[id] < 0) return NULL;
    *pos = p;
    return &s->scalars[s->memo[id]];
}

static inline int fp_after_value_ok(const Scan *s, size_t pos) {
    if (pos >= s->size) return 1;
    uint8_t nx = s->buf[pos];
    return !((nx >= 0x85 && nx <= 0x87) || nx == 'a' || nx == 's' || nx == 'q' || nx == 'r' || nx == 0x94);
}

/* A scalar's opcode at *pos: 1 if it is one (and read into v), 0 if not, -1 on bytes that end. */
static int fp_scalar(Scan *s, size_t *pos, Val *v) {
    size_t p = *pos;
    uint8_t op = s->buf[p++];
    switch (op) {
    case 'K': if (!fp_need(s, p, 1)) return -1; fp_init(v, V_INT, *pos); v->ival = s->buf[p]; p += 1; break;
    case 'M': if (!fp_need(s, p, 2)) return -1; fp_init(v, V_INT, *pos); v->ival = (int64_t)rd_le(s->buf + p, 2); p += 2; break;
    case 'J': if (!fp_need(s, p, 4)) return -1; fp_init(v, V_INT, *pos); v->ival = (int32_t)rd_le(s->buf + p, 4); p += 4; break;
    case 0x8a: {
        if (!fp_need(s, p, 1)) return -1;
        uint64_t n = s->buf[p++];
        if (n > 8 || !fp_need(s, p, n)) return -1;
        uint64_t u = n ? rd_le(s->buf + p, (int)n) : 0;
        if (n && n < 8 && (s->buf[p + n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
        p += n;
        fp_init(v, V_INT, *pos);
        v->ival = (int64_t)u;
        break;
    }
    case 'N': fp_init(v, V_NONE, *pos); break;
    case 0x88: fp_init(v, V_BOOL, *pos); v->ival = 1; break;
    case 0x89: fp_init(v, V_BOOL, *pos); break;
    case 'G': {
        if (!fp_need(s, p, 8)) return -1;
        uint64_t bits = 0;
        for (int i = 0; i < 8; i++) bits = (bits << 8) | s->buf[p + i];
        p += 8;
        fp_init(v, V_FLOAT, *pos);
        v->ival = (int64_t)bits;
        break;
    }
    case 'X': case 0x8c: {
        int w = op == 'X' ? 4 : 1;
        if (!fp_need(s, p, w)) return -1;
        uint64_t n = rd_le(s->buf + p, w);
        p += w;
        if (!fp_need(s, p, n)) return -1;
        fp_init(v, V_STR, *pos);
        v->ival = (int64_t)p;
        v->len = (uint32_t)n;
        if (n <= 40) v->field = (uint8_t)field_of(s->buf + p, n);
        p += n;
        break;
    }
    case 'h': case 'j': {
        int w = op == 'h' ? 1 : 4;
        if (!fp_need(s, p, w)) return -1;
        uint64_t id = rd_le(s->buf + p, w);
        p += w;
        if (id >= s->memo_cap || s->memo[id] < 0) return -1;
        *v = s->scalars[s->memo[id]];
        v->start = (uint32_t)*pos;
        break;
    }
    default:
        return 0;
    }
    v->end = (uint32_t)p;
    *pos = p;
    return 1;
}

/* Items of a list or pairs of a dict after its MARK, up to APPENDS / SETITEMS, hashed as the general loop does. */
static int fp_items(Scan *s, size_t *pos, Val *c, uint8_t close, int depth) {
    Val k, v;
    for (;;) {
        if (*pos >= s->size) return FP_BAIL;
        if (s->buf[*pos] == close) {
            *pos += 1;
            return FP_OK;
        }
        if (close == 'e') {
            size_t p = *pos;
            const Val *slot = fp_get(s, &p);
            if (slot && fp_after_value_ok(s, p)) {
                *pos = p;
                c->hash = combine(c->hash, slot->hash);
                c->ival += 1;
                continue;
            }
        }
        if (fp_value(s, pos, &k, depth + 1)) return FP_BAIL;
        if (close == 'e') {
            c->hash = combine(c->hash, vhash(s->buf, &k));
        } else {
            if (fp_value(s, pos, &v, depth + 1)) return FP_BAIL;
            c->hash = combine(c->hash, vhash(s->buf, &k) * 31 + vhash(s->buf, &v));
        }
        c->ival += 1;
    }
}

/* One value: a scalar, a memoized one, a list or a dict (no tuple: those are the pair loop's), and its memo. */
static int fp_value(Scan *s, size_t *pos, Val *v, int depth) {
    if (depth > 16 || *pos >= s->size) return FP_BAIL;
    int r = fp_scalar(s, pos, v);
    if (r < 0) return FP_BAIL;
    if (r == 0) {
        uint8_t op = s->buf[*pos];
        if (op != ']' && op != '}') return FP_BAIL;
        size_t start = *pos;
        fp_init(v, op == ']' ? V_LIST : V_DICT, start);
        v->hash = op == ']' ? 0x6C697374ULL : 0x64696374ULL;
        v->hashed = 1;
        *pos += 1;
        /* Python memoizes a container before its items: the memo's copy is brought up to date after them. */
        int32_t early = -1;
        if (*pos < s->size && (s->buf[*pos] == 'q' || s->buf[*pos] == 'r' || s->buf[*pos] == 0x94)) {
            if (fp_memo(s, pos, v)) return FP_BAIL;
            early = v->memo;
        }
        uint8_t close = op == ']' ? 'e' : 'u';
        while (*pos < s->size && s->buf[*pos] == '(') {
            *pos += 1;
            if (fp_items(s, pos, v, close, depth)) return FP_BAIL;
        }
        if (*pos < s->size && (s->buf[*pos] == 'a' || s->buf[*pos] == 's')) return FP_BAIL; /* one-item forms */
        v->end = (uint32_t)*pos;
        if (early >= 0) s->scalars[early] = *v;
    }
    if (*pos < s->size && (s->buf[*pos] == 'q' || s->buf[*pos] == 'r' || s->buf[*pos] == 0x94))
        if (fp_memo(s, pos, v)) return FP_BAIL;
    if (*pos < s->size) {
        uint8_t nx = s->buf[*pos];
        if (nx >= 0x85 && nx <= 0x87) return FP_BAIL; /* a tuple: the pair loop decides */
        if (nx == 'a' || nx == 's') return FP_BAIL;   /* a one-item container around this value */
    }
    return FP_OK;
}

/* A tuple of 1 to 3 scalars closing right after them (an entry's process_group): into v, else FP_BAIL. */
static int fp_tuple(Scan *s, size_t *pos, Val *v) {
    Val items[3];
    size_t start = *pos;
    int n = 0;
    while (n < 3) {
        if (*pos >= s->size) return FP_BAIL;
        int r = fp_scalar(s, pos, &items[n]);
        if (r <= 0) return FP_BAIL;
        n++;
        if (fp_memo(s, pos, &items[n - 1])) return FP_BAIL;
        if (*pos < s->size && s->buf[*pos] == 0x84 + n) {
            *pos += 1;
            fp_init(v, V_TUPLE, start);
            uint64_t h = 0x7475706C65ULL;
            for (int i = 0; i < n; i++) h = combine(h, vhash(s->buf, &items[i]));
            v->hash = h;
            v->hashed = 1;
            v->ival = n;
            v->end = (uint32_t)*pos;
            if (*pos < s->size && (s->buf[*pos] == 'q' || s->buf[*pos] == 'r' || s->buf[*pos] == 0x94))
                if (fp_memo(s, pos, v)) return FP_BAIL;
            return FP_OK;
        }
    }
    return FP_BAIL;
}

/* --- plans: an entry read again from the bytes of one alike ----------------------------------------------------

An entry of a ring that memoizes nothing (every entry after the first few of its kind: its keys, op name, state,
group, frames and dtypes are all memo fetches) has the bytes of the last entry of its kind but for its numbers
(record_id, the seq ids, the times: the same opcodes and widths, other payloads). try_entry() keeps such an entry
as a plan: its bytes, where its numbers are (holes), and its flags and value ids. try_plan() compares an entry's
bytes between the holes with a plan's and, where they match, reads only the numbers: the same row try_entry()
would fill, at a few memcmp()s an entry. Plans are this file's alone (memo ids differ between files). */

static void add_plan(Scan *s, size_t start, size_t len, const Hole *holes, int nholes, const Const *consts,
                     int nconsts) {
    int k = s->nplans < NPLANS ? s->nplans++ : (s->plan_victim++ % NPLANS);
    Plan *p = &s->plans[k];
    if (!p->bytes && !(p->bytes = malloc(PLAN_MAX))) {
        if (k == s->nplans - 1) s->nplans--;
        return;
    }
    memcpy(p->bytes, s->buf + start, len);
    p->len = (uint32_t)len;
    p->nholes = (uint16_t)nholes;
    memcpy(p->holes, holes, nholes * sizeof(Hole));
    p->nconsts = (uint16_t)nconsts;
    memcpy(p->consts, consts, nconsts * sizeof(Const));
    /* the literal runs between the holes (holes come in the order of the bytes) */
    uint16_t at = 0;
    p->nruns = 0;
    for (int i = 0; i < nholes; i++) {
        if (holes[i].off > at) {
            p->runs[p->nruns].off = at;
            p->runs[p->nruns].len = (uint16_t)(holes[i].off - at);
            p->nruns++;
        }
        at = (uint16_t)(holes[i].off + holes[i].width);
    }
    if (len > at) {
        p->runs[p->nruns].off = at;
        p->runs[p->nruns].len = (uint16_t)(len - at);
        p->nruns++;
    }
    p->next = -1;
    for (int i = 0; i < s->nplans; i++)
        if (s->plans[i].next == k) s->plans[i].next = -1; /* the plan it replaced was their successor */
    if (s->last_plan >= 0 && s->last_plan < s->nplans && s->last_plan != k) s->plans[s->last_plan].next = k;
    s->last_plan = k;
}

static inline int plan_matches(const Scan *s, const Plan *p, size_t start) {
    if (!p->len || s->size - start < p->len) return 0;
    const uint8_t *e = s->buf + start;
    for (int i = 0; i < p->nruns; i++)
        if (memcmp(e + p->runs[i].off, p->bytes + p->runs[i].off, p->runs[i].len)) return 0;
    return 1;
}

static inline int64_t hole_value(const uint8_t *b, const Hole *h) {
    uint64_t u = 0;
    memcpy(&u, b + h->off, h->width); /* little-endian payloads, as pickle writes them */
    switch (h->opcode) {
    case 'J': return (int32_t)(uint32_t)u;
    case 0x8a:
        if (h->width && h->width < 8 && (b[h->off + h->width - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * h->width);
        return (int64_t)u;
    default: return (int64_t)u; /* K, M: unsigned */
    }
}

/* 0: the entry at ``start`` matched a plan and fills its row; 1: no plan matches. */
static int try_plan(Scan *s, size_t start) {
    int k = -1;
    if (s->last_plan >= 0 && s->last_plan < s->nplans) {
        int hint = s->plans[s->last_plan].next;
        if (hint >= 0 && hint < s->nplans && plan_matches(s, &s->plans[hint], start)) k = hint;
    }
    if (k < 0)
        for (int i = 0; i < s->nplans; i++)
            if (plan_matches(s, &s->plans[i], start)) {
                k = i;
                break;
            }
    if (k < 0) {
        s->last_plan = -1;
        return 1;
    }
    const Plan *p = &s->plans[k];
    int row = new_row(s);
    if (row < 0) return 1;
    const uint8_t *e = s->buf + start;
    for (int i = 0; i < p->nholes; i++) {
        const Hole *h = &p->holes[i];
        if (h->col < 0) continue;
        int64_t x = hole_value(e, h);
        if (h->col < N_INT) s->ints[h->col][row] = x;
        else s->flags[h->col - N_INT][row] = x != 0;
    }
    for (int i = 0; i < p->nconsts; i++) {
        const Const *c = &p->consts[i];
        if (c->kind == 1) s->flags[c->col][row] = (int8_t)c->value;
        else if (c->kind == 2) s->ids[c->col][row] = c->value;
        else s->combo[row] = c->value;
    }
    Val d;
    fp_init(&d, V_DICT, start);
    d.hash = 0x64696374ULL;
    d.hashed = 1;
    d.row = row;
    d.ival = 1;
    d.end = (uint32_t)(start + p->len);
    if (push(s, &d)) {
        s->rows--;
        return 1;
    }
    if (s->last_plan >= 0 && s->last_plan < s->nplans) s->plans[s->last_plan].next = k;
    s->last_plan = k;
    s->pos = start + p->len;
    return 0;
}

/* At an EMPTY_DICT at ``start``: read it as an entry if it is one. 0: read (its dict is on the stack, its row
   filled, s->pos after its SETITEMS); 1: not an entry or not this path's (nothing changed that matters). */
static int try_entry(Scan *s, size_t start) {
    size_t pos = start + 1;
    size_t rows = s->rows, memo_next = s->memo_next;
    Val d;
    fp_init(&d, V_DICT, start);
    d.hash = 0x64696374ULL;
    d.hashed = 1;
    int32_t early = -1;
    if (pos < s->size && (s->buf[pos] == 'q' || s->buf[pos] == 'r')) {
        if (fp_memo(s, &pos, &d)) goto bail;
        early = d.memo;
    }
    if (pos >= s->size || s->buf[pos] != '(') goto bail;
    pos++;
    {
        /* only an entry: its first key names one of an entry's fields */
        size_t p = pos;
        Val k;
        if (p >= s->size || fp_scalar(s, &p, &k) != 1 || k.type != V_STR || k.field == 0 || k.field >= F_ENTRIES)
            goto bail;
    }
    int row = new_row(s);
    if (row < 0) goto bail;
    d.row = row;
    Val k, v;
    /* What a plan of this entry needs: where its numbers are, its flags and ids (pure: it memoized nothing). */
    Hole holes[PLAN_HOLES];
    Const consts[N_FIELDS + 1];
    int nholes = 0, nconsts = 0, plannable = early < 0;
    size_t nscalars = s->nscalars;
#define HOLE(o, w, opc, c) do { if (nholes < PLAN_HOLES && (o) - start < PLAN_MAX) { holes[nholes].off = (uint16_t)((o) - start); \
    holes[nholes].width = (uint8_t)(w); holes[nholes].opcode = (uint8_t)(opc); holes[nholes].col = (int8_t)(c); nholes++; } \
    else plannable = 0; } while (0)
    /* The entry's repeating values, interned once it is read whole (a bail leaves the tables as they were). */
    struct { int f; uint64_t h; uint32_t start, end; } pend[N_FIELDS];
    int npend = 0;
#define PEND(field, hash, a, b) do { if (npend >= N_FIELDS) goto bail; pend[npend].f = (field); pend[npend].h = (hash); \
    pend[npend].start = (a); pend[npend].end = (b); npend++; } while (0)
    for (;;) {
        if (pos >= s->size) goto bail;
        uint8_t op = s->buf[pos];
        if (op == 'u') {
            pos++;
            break;
        }
        int f;
        const Val *kslot = fp_get(s, &pos);
        if (kslot) {
            if (kslot->type != V_STR) goto bail;
            f = kslot->field;
        } else {
            if (fp_scalar(s, &pos, &k) != 1 || k.type != V_STR) goto bail;
            if (fp_memo(s, &pos, &k)) goto bail;
            f = k.field;
        }
        if (pos >= s->size) goto bail;
        if (f >= 1 && f < F_FIRST_VALUE) {
            /* a number (or None: the column keeps its default), read in place */
            const uint8_t *b = s->buf + pos;
            int64_t x;
            int isnum = 1;
            int col = f - 1; /* 0-8 ints, 9-10 flags */
            switch (b[0]) {
            case 'K': if (!fp_need(s, pos, 2)) goto bail; x = b[1]; HOLE(pos + 1, 1, 'K', col); pos += 2; break;
            case 'M': if (!fp_need(s, pos, 3)) goto bail; x = (int64_t)rd_le(b + 1, 2); HOLE(pos + 1, 2, 'M', col); pos += 3; break;
            case 'J': if (!fp_need(s, pos, 5)) goto bail; x = (int32_t)rd_le(b + 1, 4); HOLE(pos + 1, 4, 'J', col); pos += 5; break;
            case 0x88: x = 1; pos += 1; break;
            case 0x89: x = 0; pos += 1; break;
            case 'N': x = 0; isnum = 0; pos += 1; break;
            default: {
                size_t at = pos;
                if (fp_scalar(s, &pos, &v) != 1) goto bail;
                isnum = v.type == V_INT || v.type == V_BOOL;
                x = v.ival;
                if (s->buf[at] == 0x8a) HOLE(at + 2, pos - at - 2, 0x8a, col);
                else if (isnum) plannable = 0; /* a memoized number: no plan */
            }
            }
            if (f >= F_FIRST_FLAG && (b[0] == 0x88 || b[0] == 0x89) && nconsts < N_FIELDS) {
                consts[nconsts].kind = 1;
                consts[nconsts].col = (int8_t)(f - F_FIRST_FLAG);
                consts[nconsts].value = (int32_t)x;
                nconsts++;
            } else if (f < F_FIRST_FLAG && (b[0] == 0x88 || b[0] == 0x89)) {
                plannable = 0; /* a bool where a number goes: rare, read each time */
            }
            if (!fp_after_value_ok(s, pos)) goto bail;
            if (isnum) {
                if (f < F_FIRST_FLAG) s->ints[f - 1][row] = x;
                else s->flags[f - F_FIRST_FLAG][row] = x != 0;
            }
            continue;
        }
        if (f >= F_FIRST_VALUE && f < F_ENTRIES && f != F_FIRST_VALUE + 2) {
            size_t p = pos;
            const Val *slot = fp_get(s, &p);
            if (slot && fp_after_value_ok(s, p)) { /* a memoized value (state, op name, frames): by its slot */
                PEND(f, slot->hash, (uint32_t)pos, (uint32_t)p);
                pos = p;
                continue;
            }
        }
        if (f == F_FIRST_VALUE + 2) { /* process_group: a tuple of two strings */
            if (fp_tuple(s, &pos, &v)) goto bail;
            PEND(f, vhash(s->buf, &v), v.start, v.end);
        } else {
            size_t at = pos;
            if (fp_value(s, &pos, &v, 0)) goto bail;
            if (f >= F_FIRST_VALUE && f < F_ENTRIES) {
                PEND(f, vhash(s->buf, &v), v.start, v.end);
            } else if (pos > at) { /* a field no column keeps (duration_ms, thread_id): its number varies */
                uint8_t o = s->buf[at];
                if (o == 'K' || o == 'M' || o == 'J' || o == 'G') HOLE(at + 1, pos - at - 1, o, -1);
                else if (o == 0x8a) HOLE(at + 2, pos - at - 2, o, -1);
            }
        }
    }
#undef PEND
#undef HOLE
    for (int i = 0; i < npend; i++) {
        int32_t id = intern_hash(s, &s->tables[pend[i].f - F_FIRST_VALUE], pend[i].h, pend[i].start, pend[i].end);
        if (id < 0) goto bail;
        s->ids[pend[i].f - F_FIRST_VALUE][row] = id;
        if (nconsts < N_FIELDS) {
            consts[nconsts].kind = 2;
            consts[nconsts].col = (int8_t)(pend[i].f - F_FIRST_VALUE);
            consts[nconsts].value = id;
            nconsts++;
        } else {
            plannable = 0;
        }
    }
    {
        int32_t c = combo_of(s, (size_t)row);
        if (c < 0) goto bail;
        s->combo[row] = c;
        if (nconsts < N_FIELDS + 1) {
            consts[nconsts].kind = 3;
            consts[nconsts].col = 0;
            consts[nconsts].value = c;
            nconsts++;
        } else {
            plannable = 0;
        }
    }
    d.ival = 1;
    d.end = (uint32_t)pos;
    if (early >= 0) s->scalars[early] = d;
    if (push(s, &d)) goto bail;
    s->pos = pos;
    if (plannable && s->nscalars == nscalars && pos - start <= PLAN_MAX)
        add_plan(s, start, pos - start, holes, nholes, consts, nconsts);
    else
        s->last_plan = -1;
    return 0;
bail:
    s->rows = rows;
    /* What it memoized the general loop memoizes again, alike, as it reads the same bytes; the implicit ids of
       MEMOIZE must start where they did. */
    s->memo_next = memo_next;
    if (s->error) {
        s->error = NULL; /* a failure here (out of memory) is the general loop's to meet again */
        s->unsupported = 0;
    }
    return 1;
}

static int run(Scan *s) {
    while (s->pos < s->size) {
        uint64_t start = s->pos;
        uint8_t op = s->buf[s->pos++];
        size_t lo;
        uint64_t off;
        switch (op) {
        case 0x80: NEED(1); s->pos += 1; break;                        /* PROTO */
        case 0x95: NEED(8); s->pos += 8; break;                        /* FRAME */
        case '.': s->stopped = 1; return 0;                            /* STOP */
        case '(':                                                      /* MARK */
            if (grow((void **)&s->marks, &s->marks_cap, s->nmarks + 1, sizeof(Mark))) return fail(s, "out of memory", 0);
            s->marks[s->nmarks].sp = s->sp;
            s->marks[s->nmarks].off = start;
            s->nmarks++;
            break;
        case '}':                                                      /* EMPTY_DICT */
            if (s->fast && s->sp > 0 && (try_plan(s, start) == 0 || try_entry(s, start) == 0)) break;
            if (container(s, V_DICT, start)) return -1;
            break;
        case ']': if (container(s, V_LIST, start)) return -1; break;   /* EMPTY_LIST */
        case ')': {                                                    /* EMPTY_TUPLE */
            size_t here = s->sp;
            if (make_tuple(s, here, start)) return -1;
            break;
        }
        case 'd':                                                      /* DICT */
            if (pop_mark(s, &lo, &off)) return -1;
            {
                size_t n = s->sp - lo;
                if (grow((void **)&s->stack, &s->stack_cap, s->sp + 1, sizeof(Val))) return fail(s, "out of memory", 0);
                memmove(&s->stack[lo + 1], &s->stack[lo], n * sizeof(Val));
                Val d = {0};
                d.type = V_DICT;
                d.row = -1;
                d.memo = -1;
                d.hash = 0x64696374ULL;
                d.hashed = 1;
                d.start = (uint32_t)off;
                d.top = lo == 0;
                if (lo == 0) s->top_dict = 1;
                s->stack[lo] = d;
                s->sp++;
                if (set_items(s, lo + 1, s->sp)) return -1;
            }
            break;
        case 'l':                                                      /* LIST */
            if (pop_mark(s, &lo, &off)) return -1;
            {
                size_t n = s->sp - lo;
                if (grow((void **)&s->stack, &s->stack_cap, s->sp + 1, sizeof(Val))) return fail(s, "out of memory", 0);
                memmove(&s->stack[lo + 1], &s->stack[lo], n * sizeof(Val));
                Val l = {0};
                l.type = V_LIST;
                l.row = -1;
                l.memo = -1;
                l.hash = 0x6C697374ULL;
                l.hashed = 1;
                l.start = (uint32_t)off;
                s->stack[lo] = l;
                s->sp++;
                if (append_items(s, lo + 1, s->sp)) return -1;
            }
            break;
        case 'u': if (pop_mark(s, &lo, NULL) || set_items(s, lo, s->sp)) return -1; break;      /* SETITEMS */
        case 's': if (s->sp < 3 || set_items(s, s->sp - 2, s->sp)) return fail(s, "bad SETITEM", 0); break;
        case 'e': if (pop_mark(s, &lo, NULL) || append_items(s, lo, s->sp)) return -1; break;   /* APPENDS */
        case 'a': if (s->sp < 2 || append_items(s, s->sp - 1, s->sp)) return fail(s, "bad APPEND", 0); break;
        case 't': if (pop_mark(s, &lo, &off) || make_tuple(s, lo, off)) return -1; break;     /* TUPLE */
        case 0x85: case 0x86: case 0x87: {                             /* TUPLE1-3 */
            size_t n = op - 0x84;
            if (s->sp < n) return fail(s, "TUPLE of too few items", 0);
            if (make_tuple(s, s->sp - n, s->stack[s->sp - n].start)) return -1;
            break;
        }
        case 'J': NEED(4); { int32_t x = (int32_t)rd_le(s->buf + s->pos, 4); s->pos += 4;
                    if (scalar_int(s, x, V_INT, start)) return -1; } break;
        case 'K': NEED(1); { int64_t x = s->buf[s->pos]; s->pos += 1; if (scalar_int(s, x, V_INT, start)) return -1; } break;
        case 'M': NEED(2); { int64_t x = (int64_t)rd_le(s->buf + s->pos, 2); s->pos += 2;
                    if (scalar_int(s, x, V_INT, start)) return -1; } break;
        case 0x8a: case 0x8b: {                                        /* LONG1, LONG4 */
            int w = op == 0x8a ? 1 : 4;
            NEED(w);
            uint64_t n = rd_le(s->buf + s->pos, w);
            s->pos += w;
            NEED(n);
            if (n > 8) return fail(s, "an integer wider than 64 bits", 1);
            uint64_t u = n ? rd_le(s->buf + s->pos, (int)n) : 0;
            if (n && n < 8 && (s->buf[s->pos + n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);  /* sign */
            s->pos += n;
            if (scalar_int(s, (int64_t)u, V_INT, start)) return -1;
            break;
        }
        case 'N': if (scalar_int(s, 0, V_NONE, start)) return -1; break;
        case 0x88: if (scalar_int(s, 1, V_BOOL, start)) return -1; break;
        case 0x89: if (scalar_int(s, 0, V_BOOL, start)) return -1; break;
        case 'G': NEED(8); { uint64_t bits = 0; for (int i = 0; i < 8; i++) bits = (bits << 8) | s->buf[s->pos + i];
                    s->pos += 8; if (scalar_int(s, (int64_t)bits, V_FLOAT, start)) return -1; } break;
        case 'X': NEED(4); { uint64_t n = rd_le(s->buf + s->pos, 4); s->pos += 4; TRY(scalar_str(s, n, V_STR, start)); } break;
        case 0x8c: NEED(1); { uint64_t n = s->buf[s->pos]; s->pos += 1; TRY(scalar_str(s, n, V_STR, start)); } break;
        case 0x8d: NEED(8); { uint64_t n = rd_le(s->buf + s->pos, 8); s->pos += 8; TRY(scalar_str(s, n, V_STR, start)); } break;
        case 'B': NEED(4); { uint64_t n = rd_le(s->buf + s->pos, 4); s->pos += 4; TRY(scalar_str(s, n, V_BYTES, start)); } break;
        case 'C': NEED(1); { uint64_t n = s->buf[s->pos]; s->pos += 1; TRY(scalar_str(s, n, V_BYTES, start)); } break;
        case 0x8e: NEED(8); { uint64_t n = rd_le(s->buf + s->pos, 8); s->pos += 8; TRY(scalar_str(s, n, V_BYTES, start)); } break;
        case 'q': NEED(1); { uint64_t id = s->buf[s->pos]; s->pos += 1; if (memo_put(s, id)) return -1; } break;
        case 'r': NEED(4); { uint64_t id = rd_le(s->buf + s->pos, 4); s->pos += 4; if (memo_put(s, id)) return -1; } break;
        case 0x94: if (memo_put(s, s->memo_next)) return -1; break;   /* MEMOIZE */
        case 'h': NEED(1); { uint64_t id = s->buf[s->pos]; s->pos += 1; if (memo_get(s, id, start)) return -1; } break;
        case 'j': NEED(4); { uint64_t id = rd_le(s->buf + s->pos, 4); s->pos += 4; if (memo_get(s, id, start)) return -1; } break;
        case '0': if (!s->sp) return fail(s, "POP of an empty stack", 0); s->sp--; break;
        case '1': if (pop_mark(s, &lo, NULL)) return -1; s->sp = lo; break;
        case 'c': case 0x93: case 'R': case 'b': case 0x81: case 0x92: case 'P': case 'Q': case 'i': case 'o':
        case 0x82: case 0x83: case 0x84:
            s->pos = start;
            return fail(s, "an object a Flight Recorder dump never holds (a global, a reduce or a persistent id)", 0);
        default:
            s->pos = start;
            return fail(s, "an opcode this scanner does not read", 1);
        }
        if (s->error) return -1;
    }
    s->truncated = 1;
    return 1;
}

/* After a cut: the top dict's pairs written before the entries are still on the stack. */
static void salvage_meta(Scan *s) {
    if (s->sp < 1 || s->stack[0].type != V_DICT || !s->stack[0].top || s->nmarks < 1 || s->marks[0].sp != 1) return;
    size_t hi = s->nmarks > 1 ? s->marks[1].sp : s->sp;
    for (size_t i = 1; i + 1 < hi; i += 2) {
        Val *k = &s->stack[i];
        if (k->type == V_STR && k->field == F_ENTRIES) s->has_entries = 1;
        if (k->type != V_STR || k->field == F_ENTRIES) break;
        if (i + 1 == hi - 1 && s->nmarks > 1) break; /* its value is still being built */
        if (grow((void **)&s->meta, &s->meta_cap, s->nmeta + 2, sizeof(Val))) return;
        s->meta[s->nmeta++] = *k;
        s->meta[s->nmeta++] = s->stack[i + 1];
    }
}

/* --- Python objects of byte ranges (with the GIL) --------------------------------------------------------- */

static PyObject *scalar_object(Scan *s, const Val *v) {
    switch (v->type) {
    case V_NONE: Py_RETURN_NONE;
    case V_BOOL: return PyBool_FromLong((long)v->ival);
    case V_INT: return PyLong_FromLongLong(v->ival);
    case V_FLOAT: { uint64_t bits = (uint64_t)v->ival; double d; memcpy(&d, &bits, 8); return PyFloat_FromDouble(d); }
    case V_STR: return PyUnicode_DecodeUTF8((const char *)s->buf + v->ival, (Py_ssize_t)v->len, "replace");
    case V_BYTES: return PyBytes_FromStringAndSize((const char *)s->buf + v->ival, (Py_ssize_t)v->len);
    }
    PyErr_SetString(PyExc_ValueError, "not a scalar");
    return NULL;
}

/* The object the opcodes buf[start:end] make (their memo references resolved through the scan's memo). */
static PyObject *decode(Scan *s, uint64_t start, uint64_t end, int depth) {
    PyObject *stack = PyList_New(0);
    Py_ssize_t *marks = NULL;
    size_t nmarks = 0, marks_cap = 0;
    if (!stack) return NULL;
    uint64_t pos = start;
    PyObject *result = NULL;
#define DPUSH(o) do { PyObject *o_ = (o); if (!o_ || PyList_Append(stack, o_)) { Py_XDECREF(o_); goto done; } Py_DECREF(o_); } while (0)
#define DNEED(n) do { if (end - pos < (uint64_t)(n)) { PyErr_SetString(PyExc_ValueError, "range cut"); goto done; } } while (0)
    while (pos < end) {
        uint8_t op = s->buf[pos++];
        Py_ssize_t n = PyList_GET_SIZE(stack);
        switch (op) {
        case 0x80: pos += 1; break;
        case 0x95: pos += 8; break;
        case '(':
            if (grow((void **)&marks, &marks_cap, nmarks + 1, sizeof(Py_ssize_t))) { PyErr_NoMemory(); goto done; }
            marks[nmarks++] = n;
            break;
        case '}': DPUSH(PyDict_New()); break;
        case ']': DPUSH(PyList_New(0)); break;
        case ')': DPUSH(PyTuple_New(0)); break;
        case 'd': case 'u': case 'l': case 'e': case 't': {
            if (!nmarks) { PyErr_SetString(PyExc_ValueError, "no mark"); goto done; }
            Py_ssize_t lo = marks[--nmarks];
            PyObject *items = PyList_GetSlice(stack, lo, n);
            if (!items || PyList_SetSlice(stack, lo, n, NULL)) { Py_XDECREF(items); goto done; }
            Py_ssize_t m = PyList_GET_SIZE(items);
            PyObject *target = NULL;
            if (op == 't') {
                target = PyList_AsTuple(items);
                Py_DECREF(items);
                DPUSH(target);
                break;
            }
            if (op == 'd' || op == 'l') {
                target = op == 'd' ? PyDict_New() : PyList_New(0);
                if (!target || PyList_Append(stack, target)) { Py_XDECREF(target); Py_DECREF(items); goto done; }
                Py_DECREF(target);
            } else {
                if (lo == 0) { Py_DECREF(items); PyErr_SetString(PyExc_ValueError, "no container"); goto done; }
                target = PyList_GET_ITEM(stack, lo - 1);
            }
            int bad = 0;
            if (op == 'd' || op == 'u') {
                if (!PyDict_Check(target) || m % 2) bad = 1;
                for (Py_ssize_t i = 0; !bad && i + 1 < m; i += 2) {
                    if (PyDict_SetItem(target, PyList_GET_ITEM(items, i), PyList_GET_ITEM(items, i + 1))) bad = 1;
                }
            } else {
                if (!PyList_Check(target)) bad = 1;
                for (Py_ssize_t i = 0; !bad && i < m; i++)
                    if (PyList_Append(target, PyList_GET_ITEM(items, i))) bad = 1;
            }
            Py_DECREF(items);
            if (bad) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad container"); goto done; }
            break;
        }
        case 's': case 'a': {
            Py_ssize_t need = op == 's' ? 3 : 2;
            if (n < need) { PyErr_SetString(PyExc_ValueError, "stack"); goto done; }
            PyObject *target = PyList_GET_ITEM(stack, n - need);
            int bad;
            if (op == 's') bad = !PyDict_Check(target) || PyDict_SetItem(target, PyList_GET_ITEM(stack, n - 2), PyList_GET_ITEM(stack, n - 1));
            else bad = !PyList_Check(target) || PyList_Append(target, PyList_GET_ITEM(stack, n - 1));
            if (bad || PyList_SetSlice(stack, n - need + 1, n, NULL)) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad item"); goto done; }
            break;
        }
        case 0x85: case 0x86: case 0x87: {
            Py_ssize_t k = op - 0x84;
            if (n < k) { PyErr_SetString(PyExc_ValueError, "stack"); goto done; }
            PyObject *items = PyList_GetSlice(stack, n - k, n);
            if (!items || PyList_SetSlice(stack, n - k, n, NULL)) { Py_XDECREF(items); goto done; }
            PyObject *t = PyList_AsTuple(items);
            Py_DECREF(items);
            DPUSH(t);
            break;
        }
        case 'J': DNEED(4); DPUSH(PyLong_FromLong((int32_t)rd_le(s->buf + pos, 4))); pos += 4; break;
        case 'K': DNEED(1); DPUSH(PyLong_FromLong(s->buf[pos])); pos += 1; break;
        case 'M': DNEED(2); DPUSH(PyLong_FromLong((long)rd_le(s->buf + pos, 2))); pos += 2; break;
        case 0x8a: case 0x8b: {
            int w = op == 0x8a ? 1 : 4;
            DNEED(w);
            uint64_t m = rd_le(s->buf + pos, w);
            pos += w;
            DNEED(m);
            if (m > 8) { PyErr_SetString(PyExc_ValueError, "wide int"); goto done; }
            uint64_t u = m ? rd_le(s->buf + pos, (int)m) : 0;
            if (m && m < 8 && (s->buf[pos + m - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * m);
            pos += m;
            DPUSH(PyLong_FromLongLong((int64_t)u));
            break;
        }
        case 'N': Py_INCREF(Py_None); DPUSH(Py_None); break;
        case 0x88: Py_INCREF(Py_True); DPUSH(Py_True); break;
        case 0x89: Py_INCREF(Py_False); DPUSH(Py_False); break;
        case 'G': { DNEED(8); uint64_t bits = 0; for (int i = 0; i < 8; i++) bits = (bits << 8) | s->buf[pos + i]; pos += 8;
                    double d; memcpy(&d, &bits, 8); DPUSH(PyFloat_FromDouble(d)); break; }
        case 'X': case 0x8c: case 0x8d: case 'B': case 'C': case 0x8e: {
            int w = (op == 'X' || op == 'B') ? 4 : (op == 0x8c || op == 'C') ? 1 : 8;
            DNEED(w);
            uint64_t m = rd_le(s->buf + pos, w);
            pos += w;
            DNEED(m);
            if (op == 'B' || op == 'C' || op == 0x8e) DPUSH(PyBytes_FromStringAndSize((const char *)s->buf + pos, (Py_ssize_t)m));
            else DPUSH(PyUnicode_DecodeUTF8((const char *)s->buf + pos, (Py_ssize_t)m, "replace"));
            pos += m;
            break;
        }
        case 'q': pos += 1; break;
        case 'r': pos += 4; break;
        case 0x94: break;
        case 'h': case 'j': {
            int w = op == 'h' ? 1 : 4;
            DNEED(w);
            uint64_t id = rd_le(s->buf + pos, w);
            pos += w;
            if (id >= s->memo_cap || s->memo[id] < 0) { PyErr_SetString(PyExc_ValueError, "memo"); goto done; }
            const Val *m = &s->scalars[s->memo[id]];
            if (m->type >= V_LIST) {
                if (depth > 64 || m->start >= m->end || m->end > s->size) { PyErr_SetString(PyExc_ValueError, "memo depth"); goto done; }
                DPUSH(decode(s, m->start, m->end, depth + 1));
            } else {
                DPUSH(scalar_object(s, m));
            }
            break;
        }
        case '0': if (n) PyList_SetSlice(stack, n - 1, n, NULL); break;
        case '1': if (nmarks) PyList_SetSlice(stack, marks[--nmarks], n, NULL); break;
        default: PyErr_SetString(PyExc_ValueError, "opcode"); goto done;
        }
    }
    if (PyList_GET_SIZE(stack) >= 1) {
        result = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1);
        Py_INCREF(result);
    } else {
        PyErr_SetString(PyExc_ValueError, "empty range");
    }
done:
    free(marks);
    Py_DECREF(stack);
    return result;
#undef DPUSH
#undef DNEED
}

static void scan_free(Scan *s) {
    for (int i = 0; i < NPLANS; i++) free(s->plans[i].bytes);
    free(s->combo);
    free(s->combos);
    free(s->combo_slots);
    free(s->stack);
    free(s->marks);
    free(s->memo);
    free(s->scalars);
    free(s->meta);
    for (int i = 0; i < N_INT; i++) free(s->ints[i]);
    for (int i = 0; i < N_FLAG; i++) free(s->flags[i]);
    for (int i = 0; i < N_VALUE; i++) {
        free(s->ids[i]);
        free(s->tables[i].keys);
        free(s->tables[i].ids);
        free(s->tables[i].starts);
        free(s->tables[i].ends);
    }
}

/* Each thread keeps its last scan's arrays for the next (a dump's scan fills a few MB: fresh pages for every file
   were a tenth of the time), freed when the thread ends. */
#ifndef _WIN32
#include <pthread.h>
static pthread_key_t spare_key;
static int spare_key_made = 0;

static void spare_free(void *p) {
    if (p) {
        scan_free((Scan *)p);
        free(p);
    }
}
#endif

static Scan *scan_take(void) {
    Scan *s = NULL;
#ifndef _WIN32
    if (spare_key_made) {
        s = pthread_getspecific(spare_key);
        pthread_setspecific(spare_key, NULL);
    }
#endif
    if (!s) {
        s = calloc(1, sizeof(Scan));
        if (s) s->last_plan = -1;
        return s;
    }
    s->pos = s->sp = s->nmarks = s->nscalars = s->nmeta = s->rows = 0;
    s->memo_next = 0;
    if (s->memo_cap) memset(s->memo, 0xFF, s->memo_cap * sizeof(int32_t));
    for (int i = 0; i < N_VALUE; i++) {
        Intern *t = &s->tables[i];
        t->n = 0;
        if (t->cap) memset(t->ids, 0xFF, t->cap * sizeof(int32_t));
    }
    s->truncated = s->stopped = s->unsupported = s->top_dict = s->has_entries = 0;
    s->nplans = 0;
    s->last_plan = -1;
    s->ncombos = 0;
    if (s->combo_slots_cap) memset(s->combo_slots, 0xFF, s->combo_slots_cap * sizeof(int32_t));
    s->plan_victim = 0;
    s->error = NULL;
    return s;
}

static void scan_give_back(Scan *s) {
    s->buf = NULL;
#ifndef _WIN32
    if (spare_key_made) {
        spare_free(pthread_getspecific(spare_key));
        if (pthread_setspecific(spare_key, s) == 0) return;
    }
#endif
    scan_free(s);
    free(s);
}

static int set_new(PyObject *d, const char *key, PyObject *value) {
    if (!value) return -1;
    int r = PyDict_SetItemString(d, key, value);
    Py_DECREF(value);
    return r;
}

static PyObject *scan(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buffer", "fast", NULL};
    PyObject *arg;
    int fast = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", kwlist, &arg, &fast)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE)) return NULL;
    Scan *s = scan_take();
    if (!s) { PyBuffer_Release(&view); return PyErr_NoMemory(); }
    s->buf = view.buf;
    s->size = (size_t)view.len;
    s->fast = fast;
    if (s->size >= ((size_t)1 << 32)) {
        scan_give_back(s);
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "a dump of 4 GB or more: read it whole");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run(s);
    if (rc == 1) salvage_meta(s);
    Py_END_ALLOW_THREADS
    PyObject *out = PyDict_New(), *cols = PyDict_New(), *values = PyDict_New(), *meta = PyDict_New();
    if (!out || !cols || !values || !meta) goto fail;
    size_t n = s->rows;
    for (int i = 0; i < N_INT; i++)
        if (set_new(cols, FIELD_NAMES[1 + i], PyBytes_FromStringAndSize((const char *)s->ints[i], (Py_ssize_t)(n * 8))))
            goto fail;
    for (int i = 0; i < N_FLAG; i++)
        if (set_new(cols, FIELD_NAMES[F_FIRST_FLAG + i], PyBytes_FromStringAndSize((const char *)s->flags[i], (Py_ssize_t)n)))
            goto fail;
    for (int i = 0; i < N_VALUE; i++) {
        if (set_new(cols, FIELD_NAMES[F_FIRST_VALUE + i], PyBytes_FromStringAndSize((const char *)s->ids[i], (Py_ssize_t)(n * 4))))
            goto fail;
        Intern *t = &s->tables[i];
        PyObject *list = PyList_New((Py_ssize_t)t->n);
        if (!list) goto fail;
        for (size_t k = 0; k < t->n; k++) {
            PyObject *v = decode(s, t->starts[k], t->ends[k], 0);
            if (!v) { PyErr_Clear(); v = Py_None; Py_INCREF(v); }
            PyList_SET_ITEM(list, (Py_ssize_t)k, v);
        }
        if (set_new(values, FIELD_NAMES[F_FIRST_VALUE + i], list)) goto fail;
    }
    if (set_new(cols, "combo", PyBytes_FromStringAndSize((const char *)s->combo, (Py_ssize_t)(n * 4)))) goto fail;
    {
        PyObject *combos = PyList_New((Py_ssize_t)s->ncombos);
        if (!combos) goto fail;
        for (size_t c = 0; c < s->ncombos; c++) {
            PyObject *t = PyTuple_New(COMBO_IDS);
            if (!t) { Py_DECREF(combos); goto fail; }
            for (int i = 0; i < COMBO_IDS; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(s->combos[c * COMBO_IDS + i]));
            PyList_SET_ITEM(combos, (Py_ssize_t)c, t);
        }
        if (set_new(out, "combos", combos)) goto fail;
    }
    for (size_t k = 0; k + 1 < s->nmeta; k += 2) {
        PyObject *key = decode(s, s->meta[k].start, s->meta[k].end, 0);
        PyObject *val = key ? decode(s, s->meta[k + 1].start, s->meta[k + 1].end, 0) : NULL;
        if (key && val && PyUnicode_Check(key)) PyDict_SetItem(meta, key, val);
        if (!key || !val) PyErr_Clear();
        Py_XDECREF(key);
        Py_XDECREF(val);
    }
    if (set_new(out, "rows", PyLong_FromSize_t(n)) || PyDict_SetItemString(out, "columns", cols) ||
        PyDict_SetItemString(out, "values", values) || PyDict_SetItemString(out, "meta", meta) ||
        set_new(out, "truncated", PyBool_FromLong(rc == 1 && !s->error)) ||
        set_new(out, "unsupported", PyBool_FromLong(s->unsupported)) ||
        set_new(out, "top_dict", PyBool_FromLong(s->top_dict)) ||
        set_new(out, "has_entries", PyBool_FromLong(s->has_entries)) ||
        set_new(out, "error", s->error ? PyUnicode_FromString(s->error) : (Py_INCREF(Py_None), Py_None)))
        goto fail;
    Py_DECREF(cols);
    Py_DECREF(values);
    Py_DECREF(meta);
    scan_give_back(s);
    PyBuffer_Release(&view);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(cols);
    Py_XDECREF(values);
    Py_XDECREF(meta);
    scan_give_back(s);
    PyBuffer_Release(&view);
    return NULL;
}

#ifdef __GLIBC__
#include <malloc.h>
#endif

/* Keep freed memory in the heap (glibc's malloc): a dump's columns and the analysis's arrays of 20,000 rows are
   above glibc's 128 KB mmap threshold, so each was a fresh mapping, zeroed page by page by the kernel and given
   back at free: two thirds of the command's system time over 4,096 dumps. For the process that reads the dumps
   (distcheck report) only. */
static PyObject *retain_freed_memory(PyObject *self, PyObject *unused) {
#ifdef __GLIBC__
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"retain_freed_memory", retain_freed_memory, METH_NOARGS,
     "retain_freed_memory() -> bool: glibc's malloc keeps freed blocks of up to 32 MB for reuse (see the source)."},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_VARARGS | METH_KEYWORDS,
     "scan(buffer, fast=True) -> dict: a Flight Recorder pickle's entries as columns (see the module)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__frscan(void) {
#ifndef _WIN32
    if (!spare_key_made && pthread_key_create(&spare_key, spare_free) == 0) spare_key_made = 1;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", 1)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
