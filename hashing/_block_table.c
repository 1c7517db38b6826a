/* Which backend holds which block keys, for every backend of one cache medium, in flat
 * arrays: the prefix index's storage (hashing/prefix_index.py keeps the policy around it).
 *
 * One *entry* per (key, backend, kind), kind being confirmed (from the backend's KV
 * events, with its engine hash) or speculative (from the router's own decisions, with an
 * expiry). An entry is 31 bytes in parallel arrays: its key (u64), its value (the engine
 * hash or the expiry, 8), its neighbours in its backend's LRU list of that kind (u32 x
 * 2), the next holder of the same key (u32), its backend (u16) and kind (u8). A key's
 * holders are a chain of entries from the newest; nothing else is kept per key (a record
 * per key, 16 bytes and an id table's slot, cost more than the key in each entry: most
 * keys have one holder). Three open-addressing tables of u32 ids (linear probing,
 * backward-shift deletion, so no tombstones) find a key's newest holder by key, a
 * confirmed entry by (backend, engine hash), and an entry of a *wide* key by (key,
 * backend, kind). A key's entries are found by walking its chain while it has at most
 * NARROW of them; past that (a system prompt every backend holds) each is put in the
 * entry table, for as long as the key is held: most keys have a holder or two, and an
 * entry table's slot for each cost ~8 bytes an entry.
 * Nothing grows in one go: an id table that fills starts a table twice its size beside
 * it and each put moves a few of the old one's ids over (a whole rehash held the caller
 * 38 ms at 800k keys, and a worker's event loop with it), and the shared file's arrays
 * of ids grow in place.
 * About 40-50 bytes per (key, backend) pair all in, against ~240 in Python dicts, and nothing
 * here is a Python object: the garbage collector never walks it. A backend's id comes
 * from `member` (a hash of its name): the same in every process sharing the table.
 *
 * Holdership is taken to be prefix-closed per backend (a backend holding block i of a
 * chain holds the blocks before it), so the lookups are binary searches over a prompt's
 * key chain (`longest`, `holders`); hashing/prefix_lookup.py says why that holds.
 *
 * `BlockTable()` keeps its arrays in the process's memory: one event loop owns it, no
 * lock. `BlockTable(path)` keeps them in a file every process of a router host maps
 * (a tmpfs one: the run directory in /dev/shm), so the host holds one copy of the index
 * whatever its worker count. The file is a sparse 1 TiB address range: a header (a
 * process-shared mutex, the arena's top, the table's numbers with its arrays as
 * offsets) and an arena the arrays are cut from, never reused. An entry array is cut
 * once for the most entries there can be, and only its pages written take memory;
 * another array that grows is copied to a new region, and a region left (an old array,
 * an id table grown out of) gives its pages back to the file system (`fallocate`
 * punching a hole), so only live arrays take memory. Every call holds the
 * mutex: it reads the numbers and offsets into this process's view unless the view is
 * of the table's current version, works on the arrays, and a write stores them back as
 * a new version. The mutex is robust: when a process dies holding it, the
 * next caller finds the table possibly half-changed and starts it empty (`resets`); the
 * index is a cache of where prompts went, relearned within seconds. A growth the file
 * system has no room for (`fstatvfs`, checked before the region is used: a write past a
 * full tmpfs would kill the process) stops the write there, counted (`full`): the index
 * then holds what fits, its LRU making room as before.
 *
 * `events` applies a run of a KV event batch's common stores and removals in one call,
 * hashing the block keys with the xxhash package's own XXH3 (found in its module), so the
 * collector spends no Python call per event on them. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define NIL UINT32_MAX
/* An id table's slot holds its id + 1: 0 is an empty slot, so a table's new slots need
 * no writing (fresh pages are zeros); GONE marks a slot whose id left while the table was
 * being migrated (ids stay below 2^31). */
#define EMPTY 0
#define GONE UINT32_MAX
/* the old id table's slots each put moves into the grown one: the old one is empty long
 * before the grown one fills (a put moves 16 slots; the grown one has room for 3/4 of
 * the old one's size more ids) */
#define MIGRATE 16
#define CONF 0
#define SPEC 1
/* an entry's kind byte: its kind, and WIDE on each entry of a key found through the
 * entry table */
#define KIND 1
#define WIDE 2
/* the longest chain a key's entries are found by walking it; past it the key is wide */
#define NARROW 4
#define MAX_BACKENDS 65535
/* the shared file's address range: what every array ever cut from the arena can take */
#define ARENA_BYTES (1ULL << 40)
#define PAGE 4096
/* "kvrtab", and the layout's version in the top byte */
#define MAGIC (0x6b7672746162ULL | 5ULL << 56)

typedef struct {
    uint32_t head, tail, len;
} lru_t;

/* An id table grows without stopping the caller for a rehash of every id: a grown
 * table starts empty beside the old one, each put moves the next MIGRATE slots of the
 * old one into it, and until the old one is empty a lookup tries both. The old one
 * takes no puts, and an id leaving it leaves a GONE mark (a backward shift there could
 * move an id behind the migration's cursor, where it would never move on). */
typedef struct {
    uint32_t *slot;
    uint32_t mask, used;
    uint32_t *old; /* NULL: not growing */
    uint32_t old_mask, old_used, cursor;
} itab_t;

typedef struct arena arena_t;

typedef struct {
    /* entries */
    uint64_t *e_key;
    uint64_t *e_val;
    uint32_t *e_prev, *e_next, *e_hnext;
    uint16_t *e_backend;
    uint8_t *e_kind;
    uint32_t e_cap, e_top, e_free, e_live;
    /* keys held anywhere */
    uint32_t k_live;
    /* per backend id: an LRU list per kind, and the hash of the name it was given to
     * (0: free) */
    lru_t *lru;
    uint64_t *b_name;
    uint32_t n_backends, n_named;
    itab_t etab, gtab, ktab;
    /* where the arrays are cut from: NULL, the process's heap */
    arena_t *arena;
} Table;

/* the table's arrays, for turning them into offsets and back */
static const size_t ARRAYS[] = {
    offsetof(Table, e_key),   offsetof(Table, e_val),       offsetof(Table, e_prev),
    offsetof(Table, e_next),  offsetof(Table, e_hnext),     offsetof(Table, e_backend),
    offsetof(Table, e_kind),  offsetof(Table, lru),         offsetof(Table, b_name),
    offsetof(Table, etab.slot), offsetof(Table, gtab.slot), offsetof(Table, ktab.slot),
    offsetof(Table, etab.old),  offsetof(Table, gtab.old),  offsetof(Table, ktab.old),
};

/* the shared file's first bytes */
typedef struct {
    uint64_t magic;
    pthread_mutex_t lock;
    /* the arena's next free byte (from the file's start) */
    uint64_t top;
    /* times a process died holding the lock and the table started empty */
    uint64_t resets;
    /* writes cut short because the file system had no room for a growth */
    uint64_t full;
    /* counts the writes: a process whose view is of this version need not read it again */
    uint64_t version;
    /* the table's numbers, its arrays as offsets from the file's start */
    Table state;
} header_t;

struct arena {
    char *base;
    int fd;
    header_t *header;
};

typedef struct {
    PyObject_HEAD
    Table t;
    arena_t arena; /* base NULL: the table is the process's own */
    uint64_t seen; /* the version `t` was read at (shared) */
    int holding;   /* `hold` calls not yet let go: the lock is this process's meanwhile */
} TableObject;

static inline size_t pages(size_t bytes) { return (bytes + PAGE - 1) & ~(size_t)(PAGE - 1); }

/* the file system has room for `bytes` more (a write past a full tmpfs kills the process) */
static int arena_room(arena_t *a, size_t bytes) {
    struct statvfs fs;
    return fstatvfs(a->fd, &fs) != 0 || (uint64_t)fs.f_bavail * fs.f_frsize >= pages(bytes);
}

/* a new region of the address range, none of it written yet */
static void *arena_reserve(arena_t *a, size_t bytes) {
    size_t len = pages(bytes);
    uint64_t at = a->header->top;
    if (len == 0 || at + len > ARENA_BYTES) return NULL;
    a->header->top = at + len;
    return a->base + at;
}

static void *arena_alloc(arena_t *a, size_t bytes) {
    return arena_room(a, bytes) ? arena_reserve(a, bytes) : NULL;
}

static void arena_free(arena_t *a, void *p, size_t bytes) {
    if (p != NULL)
        fallocate(a->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (char *)p - a->base, pages(bytes));
}

/* A process's own table keeps its id tables and arrays of ids in anonymous mappings:
 * zeros until written (a new id table needs no writing), grown by `mremap` (the kernel
 * moves the pages: nothing is copied, where a heap's realloc copied a big table's arrays
 * for milliseconds). */
static void *map_new(size_t bytes) {
    void *p = mmap(NULL, pages(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void *map_grow(void *p, size_t old, size_t bytes) {
    if (p == NULL) return map_new(bytes);
    void *q = mremap(p, pages(old), pages(bytes), MREMAP_MAYMOVE);
    return q == MAP_FAILED ? NULL : q;
}

static void map_free(void *p, size_t bytes) {
    if (p != NULL) munmap(p, pages(bytes));
}

/* an id table's slots, all empty (zeros): the arena's regions are new (holes of the
 * file, read as zeros) */
static void *slots_new(Table *t, size_t bytes) {
    return t->arena == NULL ? map_new(bytes) : arena_alloc(t->arena, bytes);
}

static void slots_free(Table *t, void *p, size_t bytes) {
    if (t->arena == NULL) map_free(p, bytes);
    else arena_free(t->arena, p, bytes);
}

static void *t_realloc(Table *t, void *p, size_t old, size_t bytes) {
    if (t->arena == NULL) return PyMem_RawRealloc(p, bytes);
    void *q = arena_alloc(t->arena, bytes);
    if (q != NULL && p != NULL) {
        memcpy(q, p, old);
        arena_free(t->arena, p, old);
    }
    return q;
}

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* an entry is placed by its key, backend and kind: its place is then found again (a
 * deletion's backward shift) from the entry's own fields */
static inline uint64_t entry_hash(uint64_t key, uint32_t backend, uint32_t kind) {
    return mix(key ^ ((uint64_t)(backend * 2 + kind + 1) * 0x9e3779b97f4a7c15ULL));
}

static inline uint64_t engine_hash(uint64_t engine, uint32_t backend) {
    return mix(engine ^ ((uint64_t)(backend + 1) * 0xc2b2ae3d27d4eb4fULL));
}

/* the hash an id in each table was placed by */
static inline uint64_t etab_home(Table *t, uint32_t e) {
    return entry_hash(t->e_key[e], t->e_backend[e], t->e_kind[e] & KIND);
}
static inline uint64_t gtab_home(Table *t, uint32_t e) {
    return engine_hash(t->e_val[e], t->e_backend[e]);
}
static inline uint64_t ktab_home(Table *t, uint32_t e) { return mix(t->e_key[e]); }

enum { ETAB, GTAB, KTAB };

static inline uint64_t home(Table *t, int which, uint32_t id) {
    return which == ETAB ? etab_home(t, id) : which == GTAB ? gtab_home(t, id) : ktab_home(t, id);
}

static int itab_init(Table *t, itab_t *it, uint32_t size) {
    it->slot = slots_new(t, sizeof(uint32_t) * size);
    if (it->slot == NULL) return -1;
    it->mask = size - 1;
    it->used = 0;
    return 0;
}

/* place `id`, known to be absent, in `it`'s current slots */
static inline void itab_place(itab_t *it, uint32_t id, uint64_t h) {
    uint32_t j = (uint32_t)h & it->mask;
    while (it->slot[j] != EMPTY) j = (j + 1) & it->mask;
    it->slot[j] = id + 1;
    it->used++;
}

/* move up to `n` of the old slots into the current ones; the old ones go once all moved */
static void itab_migrate(Table *t, int which, itab_t *it, uint32_t n) {
    uint32_t size = it->old_mask + 1;
    for (; n > 0 && it->cursor < size; n--, it->cursor++) {
        uint32_t v = it->old[it->cursor];
        if (v == EMPTY || v == GONE) continue;
        it->old[it->cursor] = GONE;
        it->old_used--;
        itab_place(it, v - 1, home(t, which, v - 1));
    }
    if (it->cursor == size) {
        slots_free(t, it->old, sizeof(uint32_t) * size);
        it->old = NULL;
    }
}

/* twice the slots, the ids still in the old ones until puts move them over */
static int itab_grow(Table *t, int which, itab_t *it) {
    if (it->old != NULL) itab_migrate(t, which, it, UINT32_MAX); /* a grown table already full */
    uint32_t old_size = it->mask + 1, *old = it->slot, used = it->used;
    if (old_size >= (1u << 31)) return -1;
    if (itab_init(t, it, old_size * 2) < 0) {
        it->slot = old;
        it->mask = old_size - 1;
        it->used = used;
        return -1;
    }
    it->old = old;
    it->old_mask = old_size - 1;
    it->old_used = used;
    it->cursor = 0;
    return 0;
}

/* place `id`, known to be absent, hashed by `h` */
static int itab_put(Table *t, int which, itab_t *it, uint32_t id, uint64_t h) {
    if (it->old != NULL) itab_migrate(t, which, it, MIGRATE);
    if ((uint64_t)(it->used + it->old_used + 1) * 4 > (uint64_t)(it->mask + 1) * 3 &&
        itab_grow(t, which, it) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    itab_place(it, id, h);
    return 0;
}

/* the slot of `id` among `slot` (`mask`), probing from `h`'s; NIL if absent */
static inline uint32_t itab_slot(const uint32_t *slot, uint32_t mask, uint32_t id, uint64_t h) {
    for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
        if (slot[i] == id + 1) return i;
        if (slot[i] == EMPTY) return NIL;
    }
}

/* take `id` out of the table, `h` being the hash it was placed by */
static void itab_del(Table *t, int which, itab_t *it, uint32_t id, uint64_t h) {
    uint32_t mask = it->mask, i = itab_slot(it->slot, mask, id, h);
    if (i == NIL) {
        if (it->old != NULL && (i = itab_slot(it->old, it->old_mask, id, h)) != NIL) {
            it->old[i] = GONE;
            it->old_used--;
        }
        return;
    }
    it->slot[i] = EMPTY;
    it->used--;
    for (uint32_t j = (i + 1) & mask; it->slot[j] != EMPTY; j = (j + 1) & mask) {
        uint32_t at = (uint32_t)home(t, which, it->slot[j] - 1) & mask;
        if (((j - at) & mask) >= ((j - i) & mask)) {
            it->slot[i] = it->slot[j];
            it->slot[j] = EMPTY;
            i = j;
        }
    }
}

/* Each lookup probes the current slots, then the old ones while the table grows (GONE
 * marks there are passed over). */

static uint32_t key_in(Table *t, const uint32_t *slot, uint32_t mask, uint64_t key) {
    for (uint32_t j = (uint32_t)mix(key) & mask;; j = (j + 1) & mask) {
        uint32_t v = slot[j];
        if (v == EMPTY) return NIL;
        if (v != GONE && t->e_key[v - 1] == key) return v - 1;
    }
}

/* the newest entry holding `key` (its chain's head), NIL when none does */
static uint32_t key_find(Table *t, uint64_t key) {
    itab_t *it = &t->ktab;
    uint32_t k = key_in(t, it->slot, it->mask, key);
    return k != NIL || it->old == NULL ? k : key_in(t, it->old, it->old_mask, key);
}

static uint32_t entry_in(Table *t, const uint32_t *slot, uint32_t mask, uint64_t key,
                         uint32_t backend, uint32_t kind) {
    for (uint32_t j = (uint32_t)entry_hash(key, backend, kind) & mask;; j = (j + 1) & mask) {
        uint32_t v = slot[j], e = v - 1;
        if (v == EMPTY) return NIL;
        if (v != GONE && t->e_key[e] == key && t->e_backend[e] == backend &&
            (t->e_kind[e] & KIND) == kind)
            return e;
    }
}

/* a wide key's entry for (backend, kind), from the entry table */
static uint32_t wide_find(Table *t, uint64_t key, uint32_t backend, uint32_t kind) {
    itab_t *it = &t->etab;
    uint32_t e = entry_in(t, it->slot, it->mask, key, backend, kind);
    return e != NIL || it->old == NULL ? e
                                       : entry_in(t, it->old, it->old_mask, key, backend, kind);
}

/* the entry of (key, backend, kind): among a narrow key's few holders, walked from its
 * chain's head, or a wide key's from the entry table */
static uint32_t entry_find(Table *t, uint64_t key, uint32_t backend, uint32_t kind) {
    uint32_t e = key_find(t, key);
    if (e != NIL && t->e_kind[e] & WIDE) return wide_find(t, key, backend, kind);
    for (; e != NIL; e = t->e_hnext[e])
        if (t->e_backend[e] == backend && t->e_kind[e] == kind) return e;
    return NIL;
}

static uint32_t engine_in(Table *t, const uint32_t *slot, uint32_t mask, uint64_t engine,
                          uint32_t backend) {
    for (uint32_t j = (uint32_t)engine_hash(engine, backend) & mask;; j = (j + 1) & mask) {
        uint32_t v = slot[j], e = v - 1;
        if (v == EMPTY) return NIL;
        if (v != GONE && t->e_backend[e] == backend && t->e_val[e] == engine) return e;
    }
}

static uint32_t engine_find(Table *t, uint64_t engine, uint32_t backend) {
    itab_t *it = &t->gtab;
    uint32_t e = engine_in(t, it->slot, it->mask, engine, backend);
    return e != NIL || it->old == NULL ? e : engine_in(t, it->old, it->old_mask, engine, backend);
}

static inline lru_t *list_of(Table *t, uint32_t backend, uint32_t kind) {
    return &t->lru[backend * 2 + kind];
}

/* the backend's entry of `kind` for `key`, if any: none to look for while it has no
 * entries of that kind (a backend without KV events has no confirmed ones) */
static inline uint32_t kind_find(Table *t, uint64_t key, uint32_t backend, uint32_t kind) {
    return list_of(t, backend, kind)->len ? entry_find(t, key, backend, kind) : NIL;
}

/* the backend holds `key`, of either kind: one walk of a narrow key's chain */
static inline int held(Table *t, uint64_t key, uint32_t backend) {
    lru_t *l = list_of(t, backend, CONF);
    if (l[CONF].len == 0 && l[SPEC].len == 0) return 0;
    uint32_t e = key_find(t, key);
    if (e != NIL && t->e_kind[e] & WIDE)
        return (l[CONF].len && wide_find(t, key, backend, CONF) != NIL) ||
               (l[SPEC].len && wide_find(t, key, backend, SPEC) != NIL);
    for (; e != NIL; e = t->e_hnext[e])
        if (t->e_backend[e] == backend) return 1;
    return 0;
}

#define GROW(arr, old, cap) \
    do { \
        void *p_ = t_realloc(t, (arr), sizeof(*(arr)) * (size_t)(old), sizeof(*(arr)) * (size_t)(cap)); \
        if (p_ == NULL) return -1; \
        (arr) = p_; \
    } while (0)

/* the next capacity of an array of ids after `cap` (0: none yet); 0 past the ids' range */
static inline uint32_t next_cap(uint32_t cap) {
    uint64_t next = cap ? (uint64_t)cap * 2 : 1024;
    return next >= NIL ? 0 : (uint32_t)next;
}

/* the most items an array of ids holds (next_cap's last capacity) */
#define MAX_IDS (1ULL << 31)

/* an array of `width`-byte items grown from `old` to `cap` of them. In the shared file it
 * stays where it is: its region, cut once for MAX_IDS items, is an address range whose
 * pages take memory only once written, so a growth copies nothing (a copy of a big
 * table's arrays held every process's calls for tens of milliseconds); the file system
 * is asked for room for the items added. */
static int ids_grow(Table *t, void **arr, size_t width, uint32_t old, uint32_t cap) {
    if (t->arena == NULL) {
        void *p = map_grow(*arr, width * old, width * cap);
        if (p == NULL) return -1;
        *arr = p;
        return 0;
    }
    if (!arena_room(t->arena, width * (size_t)(cap - old))) return -1;
    if (*arr == NULL && (*arr = arena_reserve(t->arena, width * MAX_IDS)) == NULL) return -1;
    return 0;
}

#define GROW_IDS(arr, old, cap) \
    do { \
        void *p_ = (arr); \
        if (ids_grow(t, &p_, sizeof(*(arr)), (old), (cap)) < 0) return -1; \
        (arr) = p_; \
    } while (0)

static int entries_grow(Table *t) {
    uint32_t cap = next_cap(t->e_cap);
    if (cap == 0) return -1;
    GROW_IDS(t->e_key, t->e_cap, cap);
    GROW_IDS(t->e_val, t->e_cap, cap);
    GROW_IDS(t->e_prev, t->e_cap, cap);
    GROW_IDS(t->e_next, t->e_cap, cap);
    GROW_IDS(t->e_hnext, t->e_cap, cap);
    GROW_IDS(t->e_backend, t->e_cap, cap);
    GROW_IDS(t->e_kind, t->e_cap, cap);
    t->e_cap = cap;
    return 0;
}

static int backends_grow(Table *t, uint32_t backend) {
    if (backend < t->n_backends) return 0;
    uint32_t n = t->n_backends ? t->n_backends : 16;
    while (n <= backend) n *= 2;
    GROW(t->lru, (size_t)t->n_backends * 2, (size_t)n * 2);
    GROW(t->b_name, t->n_backends, n);
    for (uint32_t i = t->n_backends * 2; i < n * 2; i++) t->lru[i] = (lru_t){NIL, NIL, 0};
    memset(t->b_name + t->n_backends, 0, sizeof(uint64_t) * (n - t->n_backends));
    t->n_backends = n;
    return 0;
}

static void lru_unlink(Table *t, lru_t *l, uint32_t e) {
    uint32_t p = t->e_prev[e], n = t->e_next[e];
    if (p == NIL) l->head = n; else t->e_next[p] = n;
    if (n == NIL) l->tail = p; else t->e_prev[n] = p;
    l->len--;
}

static void lru_append(Table *t, lru_t *l, uint32_t e) {
    t->e_prev[e] = l->tail;
    t->e_next[e] = NIL;
    if (l->tail == NIL) l->head = e; else t->e_next[l->tail] = e;
    l->tail = e;
    l->len++;
}

/* the key table's slot holding `from` (an entry of `key`) holds `to` instead: the chain
 * of `key` has a new head (both hash alike, so the slot is the same) */
static void key_moved(Table *t, uint64_t key, uint32_t from, uint32_t to) {
    itab_t *it = &t->ktab;
    uint32_t i = itab_slot(it->slot, it->mask, from, mix(key));
    if (i != NIL) {
        it->slot[i] = to + 1;
    } else if (it->old != NULL && (i = itab_slot(it->old, it->old_mask, from, mix(key))) != NIL) {
        it->old[i] = to + 1;
    }
}

/* the key whose chain starts at `head` becomes wide: each of its entries goes into the
 * entry table (all or none: -1 when out of memory) */
static int widen(Table *t, uint32_t head) {
    uint32_t e = head;
    for (; e != NIL; e = t->e_hnext[e]) {
        if (itab_put(t, ETAB, &t->etab, e, etab_home(t, e)) < 0) break;
        t->e_kind[e] |= WIDE;
    }
    if (e == NIL) return 0;
    for (uint32_t f = head; f != e; f = t->e_hnext[f]) {
        itab_del(t, ETAB, &t->etab, f, etab_home(t, f));
        t->e_kind[f] &= KIND;
    }
    return -1;
}

/* the key whose chain starts at `head` (NIL: none) takes a new entry in the entry table:
 * it is wide, or its chain is as long as a narrow one gets and it becomes wide */
static int goes_wide(Table *t, uint32_t head) {
    if (head == NIL) return 0;
    if (t->e_kind[head] & WIDE) return 1;
    uint32_t n = 0;
    for (uint32_t e = head; e != NIL && n < NARROW; e = t->e_hnext[e]) n++;
    return n < NARROW ? 0 : widen(t, head) < 0 ? -1 : 1;
}

/* a new entry for (key, backend, kind), known to be absent, `head` being the key's newest
 * holder (NIL: the key is held nowhere); NIL when out of memory */
static uint32_t entry_new(Table *t, uint64_t key, uint32_t head, uint32_t backend,
                          uint32_t kind, uint64_t val) {
    if (t->e_free == NIL && t->e_top == t->e_cap && entries_grow(t) < 0) {
        PyErr_NoMemory();
        return NIL;
    }
    uint32_t e;
    if (t->e_free != NIL) {
        e = t->e_free;
        t->e_free = t->e_next[e];
    } else {
        e = t->e_top++;
    }
    t->e_key[e] = key;
    t->e_val[e] = val;
    t->e_backend[e] = (uint16_t)backend;
    t->e_kind[e] = (uint8_t)kind;
    int wide = goes_wide(t, head);
    if (wide > 0) t->e_kind[e] |= WIDE;
    if (wide < 0 || (wide && itab_put(t, ETAB, &t->etab, e, entry_hash(key, backend, kind)) < 0)) {
        t->e_next[e] = t->e_free;
        t->e_free = e;
        return NIL;
    }
    if (head == NIL) {
        if (itab_put(t, KTAB, &t->ktab, e, mix(key)) < 0) {
            t->e_next[e] = t->e_free;
            t->e_free = e;
            return NIL;
        }
        t->k_live++;
    } else {
        key_moved(t, key, head, e);
    }
    t->e_hnext[e] = head;
    lru_append(t, list_of(t, backend, kind), e);
    t->e_live++;
    return e;
}

static void entry_free(Table *t, uint32_t e) {
    uint64_t key = t->e_key[e];
    uint32_t backend = t->e_backend[e], kind = t->e_kind[e] & KIND;
    lru_unlink(t, list_of(t, backend, kind), e);
    if (kind == CONF) /* gone already when its engine hash went to another key */
        itab_del(t, GTAB, &t->gtab, e, engine_hash(t->e_val[e], backend));
    if (t->e_kind[e] & WIDE) itab_del(t, ETAB, &t->etab, e, entry_hash(key, backend, kind));
    uint32_t head = key_find(t, key), next = t->e_hnext[e];
    if (head != e) {
        uint32_t *link = &t->e_hnext[head];
        while (*link != e) link = &t->e_hnext[*link];
        *link = next;
    } else if (next != NIL) {
        key_moved(t, key, e, next);
    } else {
        itab_del(t, KTAB, &t->ktab, e, mix(key));
        t->k_live--;
    }
    t->e_next[e] = t->e_free;
    t->e_free = e;
    t->e_live--;
}

/* ---- argument helpers ---- */

static int as_backend(PyObject *o, uint32_t *out) {
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (v >= MAX_BACKENDS) {
        PyErr_SetString(PyExc_ValueError, "backend id out of range");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static inline int as_u64(PyObject *o, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLong(o);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int check_args(Py_ssize_t n, Py_ssize_t want, const char *name) {
    if (n == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, n);
    return -1;
}

/* ---- writes ---- */

/* the ints of a sequence as u64s, in a buffer the caller frees with PyMem_Free (`len`
 * of them); NULL with an exception set */
static uint64_t *u64s(PyObject *obj, Py_ssize_t *len) {
    PyObject *seq = PySequence_Fast(obj, "expected a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *out = PyMem_Malloc(sizeof(uint64_t) * (n ? n : 1));
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        if (as_u64(items[i], &out[i]) < 0) {
            PyMem_Free(out);
            out = NULL;
        }
    }
    Py_DECREF(seq);
    if (out == NULL && !PyErr_Occurred()) PyErr_NoMemory();
    *len = n;
    return out;
}

/* an expiry argument (a float) as the 8 bytes an entry keeps */
static int as_expiry(PyObject *o, uint64_t *out) {
    double at = PyFloat_AsDouble(o);
    if (at == -1.0 && PyErr_Occurred()) return -1;
    memcpy(out, &at, sizeof at);
    return 0;
}

/* entry e of list l takes value val and becomes its most recently used */
static inline void renew(Table *t, lru_t *l, uint32_t e, uint64_t val) {
    t->e_val[e] = val;
    lru_unlink(t, l, e);
    lru_append(t, l, e);
}

/* the (backend, keys, expires_at) arguments of speculate and touch; -1 with an exception
 * set, else `keys` is the caller's to free */
static int keys_until(PyObject *const *args, Py_ssize_t n, const char *name, uint32_t *b,
                      uint64_t **keys, Py_ssize_t *len, uint64_t *val) {
    if (check_args(n, 3, name) < 0 || as_backend(args[0], b) < 0 || as_expiry(args[2], val) < 0)
        return -1;
    return (*keys = u64s(args[1], len)) == NULL ? -1 : 0;
}

/* speculate(backend, keys, expires_at): each key the most recently used, until expires_at */
static PyObject *do_speculate(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t val, *keys;
    Py_ssize_t len;
    if (keys_until(args, n, "speculate", &b, &keys, &len, &val) < 0) return NULL;
    if (backends_grow(t, b) < 0) {
        PyMem_Free(keys);
        return PyErr_NoMemory();
    }
    lru_t *l = list_of(t, b, SPEC);
    Py_ssize_t i = 0;
    for (; i < len; i++) {
        uint32_t e = kind_find(t, keys[i], b, SPEC);
        if (e != NIL) renew(t, l, e, val);
        else if (entry_new(t, keys[i], key_find(t, keys[i]), b, SPEC, val) == NIL) break;
    }
    PyMem_Free(keys);
    if (i < len) return NULL;
    Py_RETURN_NONE;
}

/* touch(backend, keys, expires_at): the speculative ones among keys become the most
 * recently used, the first of them last (so a chain's head leaves last) */
static PyObject *do_touch(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t val, *keys;
    Py_ssize_t len;
    if (keys_until(args, n, "touch", &b, &keys, &len, &val) < 0) return NULL;
    lru_t *l = b < t->n_backends ? list_of(t, b, SPEC) : NULL;
    for (Py_ssize_t i = len - 1; i >= 0 && l != NULL; i--) {
        uint32_t e = kind_find(t, keys[i], b, SPEC);
        if (e != NIL) renew(t, l, e, val);
    }
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

/* the backend's confirmed entries for `len` (key, engine hash) pairs, the most recently
 * stored (the backend's id known to the table); -1 with MemoryError set, the pairs before
 * the one that failed held */
static int confirm_pairs(Table *t, uint32_t b, const uint64_t *keys, const uint64_t *engines,
                         Py_ssize_t len) {
    lru_t *l = list_of(t, b, CONF);
    for (Py_ssize_t i = 0; i < len; i++) {
        uint64_t key = keys[i], engine = engines[i];
        uint32_t e = kind_find(t, key, b, CONF);
        if (e != NIL) {
            itab_del(t, GTAB, &t->gtab, e, engine_hash(t->e_val[e], b));
            renew(t, l, e, engine);
        } else if ((e = entry_new(t, key, key_find(t, key), b, CONF, engine)) == NIL) {
            return -1;
        }
        uint32_t old = engine_find(t, engine, b);
        if (old == e) continue;
        if (old != NIL) itab_del(t, GTAB, &t->gtab, old, engine_hash(engine, b));
        if (itab_put(t, GTAB, &t->gtab, e, engine_hash(engine, b)) < 0) return -1;
    }
    return 0;
}

/* confirm(backend, keys, engines): (key, engine hash) pairs, the most recently stored */
static PyObject *do_confirm(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t *keys, *engines;
    Py_ssize_t len, engines_len;
    if (check_args(n, 3, "confirm") < 0 || as_backend(args[0], &b) < 0) return NULL;
    if (backends_grow(t, b) < 0) return PyErr_NoMemory();
    if ((keys = u64s(args[1], &len)) == NULL) return NULL;
    if ((engines = u64s(args[2], &engines_len)) == NULL) {
        PyMem_Free(keys);
        return NULL;
    }
    if (engines_len < len) len = engines_len;
    int ok = confirm_pairs(t, b, keys, engines, len);
    PyMem_Free(keys);
    PyMem_Free(engines);
    if (ok < 0) return NULL;
    Py_RETURN_NONE;
}

/* trim(backend, confirmed, speculative): the least recently used keys of each kind past
 * those bounds go; returns how many */
static PyObject *do_trim(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    if (check_args(n, 3, "trim") < 0 || as_backend(args[0], &b) < 0) return NULL;
    Py_ssize_t bound[2] = {PyLong_AsSsize_t(args[1]), PyLong_AsSsize_t(args[2])};
    if (PyErr_Occurred()) return NULL;
    long gone = 0;
    for (uint32_t kind = 0; b < t->n_backends && kind < 2; kind++) {
        lru_t *l = list_of(t, b, kind);
        while ((Py_ssize_t)l->len > (bound[kind] < 0 ? 0 : bound[kind])) {
            entry_free(t, l->head);
            gone++;
        }
    }
    return PyLong_FromLong(gone);
}

/* the backend's block it reported as `engine` is gone: its entries of both kinds go */
static void remove_engine(Table *t, uint32_t b, uint64_t engine) {
    uint32_t e = engine_find(t, engine, b);
    if (e == NIL) return;
    uint32_t spec = kind_find(t, t->e_key[e], b, SPEC);
    entry_free(t, e);
    if (spec != NIL) entry_free(t, spec);
}

/* removed(backend, engines): a BlockRemoved; a block's speculative entry goes too */
static PyObject *do_removed(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t *engines;
    Py_ssize_t len;
    if (check_args(n, 2, "removed") < 0 || as_backend(args[0], &b) < 0) return NULL;
    if ((engines = u64s(args[1], &len)) == NULL) return NULL;
    for (Py_ssize_t i = 0; i < len && b < t->n_backends; i++) remove_engine(t, b, engines[i]);
    PyMem_Free(engines);
    Py_RETURN_NONE;
}

/* ---- a KV event batch in one call ---- */

/* xxh3-64 with a seed, the block keys' hash (hashing/blocks.py): the xxhash package's own,
 * from its extension module's exported symbols; NULL where they are not there, and
 * `events` then leaves every store to the caller */
typedef uint64_t (*xxh3_seeded_t)(const void *data, size_t len, uint64_t seed);
static xxh3_seeded_t xxh3_seeded = NULL;

static void find_xxh3(void) {
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    PyObject *file = mod == NULL ? NULL : PyObject_GetAttrString(mod, "__file__");
    const char *path = file == NULL ? NULL : PyUnicode_AsUTF8(file);
    void *lib = path == NULL ? NULL : dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib != NULL) {
        void *found = dlsym(lib, "XXH3_64bits_withSeed");
        memcpy(&xxh3_seeded, &found, sizeof found);
    } /* the handle stays open, as the module stays loaded */
    Py_XDECREF(file);
    Py_XDECREF(mod);
    PyErr_Clear();
}

/* the event fields read, as interned names (set at the module's import) */
static PyObject *s_medium, *s_block_hashes, *s_token_ids, *s_block_size, *s_parent, *s_lora,
    *s_extra;

/* an attribute of an event, a new reference (Py_None where it fails: the caller then
 * leaves the event to Python, whose path raises or skips as it always has) */
static PyObject *field(PyObject *ev, PyObject *name) {
    PyObject *v = PyObject_GetAttr(ev, name);
    if (v == NULL) {
        PyErr_Clear();
        v = Py_NewRef(Py_None);
    }
    return v;
}

static int is_field_none(PyObject *ev, PyObject *name) {
    PyObject *v = field(ev, name);
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

/* the event is of the GPU medium (named or not) */
static int on_gpu(PyObject *ev) {
    PyObject *m = field(ev, s_medium);
    int gpu = m == Py_None || (PyUnicode_Check(m) && (PyUnicode_CompareWithASCIIString(m, "GPU") == 0 ||
                                                      PyUnicode_CompareWithASCIIString(m, "gpu") == 0));
    Py_DECREF(m);
    return gpu;
}

/* a list of ints (None: empty) as u64s, masked as the applier's as_uint64 does, into a
 * buffer of `cap` grown as needed; -1 when it is neither (e.g. a hash as bytes) */
static Py_ssize_t masked(PyObject *list, uint64_t **buf, size_t *cap) {
    if (list == Py_None) return 0;
    if (!PyList_Check(list)) return -1;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if ((size_t)n > *cap) {
        uint64_t *grown = PyMem_Realloc(*buf, sizeof(uint64_t) * (size_t)n);
        if (grown == NULL) return -1;
        *buf = grown;
        *cap = (size_t)n;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyLong_Check(item)) return -1;
        (*buf)[i] = PyLong_AsUnsignedLongLongMask(item);
    }
    return n;
}

/* the chained keys of the full blocks of `tokens` (a list of ints) from `parent`, into
 * `keys` (room for len / block_size); how many, or -1 for a token id outside uint32 */
static Py_ssize_t chained(PyObject *tokens, Py_ssize_t block_size, uint64_t parent,
                          uint64_t *keys, uint8_t *ids) {
    Py_ssize_t blocks = PyList_GET_SIZE(tokens) / block_size;
    for (Py_ssize_t j = 0; j < blocks; j++) {
        for (Py_ssize_t i = 0; i < block_size; i++) {
            PyObject *item = PyList_GET_ITEM(tokens, j * block_size + i);
            unsigned long long id = PyLong_Check(item) ? PyLong_AsUnsignedLongLong(item) : ~0ULL;
            if (id > UINT32_MAX) {
                PyErr_Clear();
                return -1;
            }
            for (int byte = 0; byte < 4; byte++) /* little-endian, as pack_ids packs them */
                ids[4 * i + byte] = (uint8_t)(id >> (8 * byte));
        }
        parent = keys[j] = xxh3_seeded(ids, sizeof(uint32_t) * (size_t)block_size, parent);
    }
    return blocks;
}

/* outcome of one event: applied, skipped (as the caller's path would skip it), left to
 * the caller, or failed (an exception set) */
enum { APPLIED, SKIPPED, LEFT, FAILED };

static int one_removal(Table *t, uint32_t b, PyObject *ev, uint64_t **buf, size_t *cap) {
    if (!on_gpu(ev)) return LEFT;
    PyObject *hashes = field(ev, s_block_hashes);
    Py_ssize_t n = masked(hashes, buf, cap);
    Py_DECREF(hashes);
    if (n < 0) return PyErr_Occurred() ? FAILED : LEFT;
    for (Py_ssize_t i = 0; i < n && b < t->n_backends; i++) remove_engine(t, b, (*buf)[i]);
    return APPLIED;
}

typedef struct {
    uint64_t *engines, *keys;
    uint8_t *ids; /* one block's token ids, packed */
    size_t engines_cap, keys_cap;
    Py_ssize_t block_size;
    uint64_t root;
    long orphans;
} storing_t;

static int one_store(Table *t, uint32_t b, PyObject *ev, storing_t *st) {
    if (!on_gpu(ev) || !is_field_none(ev, s_lora) || !is_field_none(ev, s_extra)) return LEFT;
    PyObject *tokens = field(ev, s_token_ids), *hashes = field(ev, s_block_hashes);
    PyObject *size = field(ev, s_block_size), *parent = field(ev, s_parent);
    int out = LEFT;
    Py_ssize_t n_engines = masked(hashes, &st->engines, &st->engines_cap);
    if (!PyList_Check(tokens) || PyList_GET_SIZE(tokens) == 0 || n_engines < 0 ||
        (parent != Py_None && !PyLong_Check(parent))) {
        out = PyErr_Occurred() ? FAILED : LEFT; /* no tokens (an offload tier's), bytes */
        goto done;
    }
    out = SKIPPED;
    Py_ssize_t sized = PyLong_Check(size) ? PyLong_AsSsize_t(size) : -1;
    PyErr_Clear(); /* a size past Py_ssize_t is another size */
    if (sized != st->block_size) goto done;
    uint64_t from = st->root;
    if (parent != Py_None) {
        uint32_t e = engine_find(t, PyLong_AsUnsignedLongLongMask(parent), b);
        if (e == NIL) {
            st->orphans++;
            goto done;
        }
        from = t->e_key[e];
    }
    size_t blocks = (size_t)(PyList_GET_SIZE(tokens) / st->block_size);
    if (blocks > st->keys_cap) {
        uint64_t *grown = PyMem_Realloc(st->keys, sizeof(uint64_t) * blocks);
        if (grown == NULL) {
            PyErr_NoMemory();
            out = FAILED;
            goto done;
        }
        st->keys = grown;
        st->keys_cap = blocks;
    }
    Py_ssize_t made = chained(tokens, st->block_size, from, st->keys, st->ids);
    if (made < 0) goto done; /* a token id nothing can hash */
    out = confirm_pairs(t, b, st->keys, st->engines, made < n_engines ? made : n_engines) < 0
              ? FAILED
              : APPLIED;
done:
    Py_DECREF(tokens);
    Py_DECREF(hashes);
    Py_DECREF(size);
    Py_DECREF(parent);
    return out;
}

/* events(backend, events, start, block_size, root, stores, removals): a KV event batch's
 * stores and removals (msgspec structs, router/telemetry/kv_events.py: `stores` and
 * `removals` their types) from `start` on, in order, for as long as each is one this
 * takes whole: on the GPU medium, with ints for hashes, a store with token ids and
 * neither LoRA nor extra keys (its chain starts at `root` or at its parent's key). It
 * stops at the first other event, which the caller applies before it calls again from
 * the next. A store of another block size, of an unknown parent or of a token id outside
 * uint32 is skipped, as the caller's path skips it; a store the shared file has no room
 * for keeps what fit, counted (`full`), as `confirm`. Returns (where it stopped, stores
 * applied, removals applied, stores skipped, of which for an unknown parent). */
static PyObject *do_events(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    storing_t st = {0};
    if (check_args(n, 7, "events") < 0 || as_backend(args[0], &b) < 0 ||
        as_u64(args[4], &st.root) < 0)
        return NULL;
    PyObject *events = args[1], *stores = args[5], *removals = args[6];
    Py_ssize_t i = PyLong_AsSsize_t(args[2]);
    st.block_size = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_Check(events) || !PyTuple_Check(stores) || !PyTuple_Check(removals) ||
        st.block_size <= 0) {
        PyErr_SetString(PyExc_TypeError, "events(backend, list, start, block_size, root, types, types)");
        return NULL;
    }
    if (backends_grow(t, b) < 0) return PyErr_NoMemory();
    st.ids = PyMem_Malloc(sizeof(uint32_t) * (size_t)st.block_size);
    if (st.ids == NULL) return PyErr_NoMemory();
    long counts[3] = {0, 0, 0}; /* stored, removed, skipped */
    int out = APPLIED;
    for (; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i), *type = (PyObject *)Py_TYPE(ev);
        int store = PySequence_Contains(stores, type) == 1;
        if (store && xxh3_seeded != NULL) out = one_store(t, b, ev, &st);
        else if (!store && PySequence_Contains(removals, type) == 1)
            out = one_removal(t, b, ev, &st.engines, &st.engines_cap);
        else out = LEFT;
        if (out == FAILED && t->arena != NULL && PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear(); /* no room in the shared file: what fit is held, as `confirm` */
            t->arena->header->full++;
            out = APPLIED;
        }
        if (out == LEFT || out == FAILED) break;
        counts[out == SKIPPED ? 2 : store ? 0 : 1]++;
    }
    PyMem_Free(st.ids);
    PyMem_Free(st.engines);
    PyMem_Free(st.keys);
    if (out == FAILED) return NULL;
    return Py_BuildValue("(nllll)", i, counts[0], counts[1], counts[2], st.orphans);
}

/* clear(backend, kind): every entry of that kind goes (None: both) */
static PyObject *do_clear(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    if (check_args(n, 2, "clear") < 0 || as_backend(args[0], &b) < 0) return NULL;
    long first = CONF, last = SPEC;
    if (args[1] != Py_None) {
        first = last = PyLong_AsLong(args[1]);
        if (first == -1 && PyErr_Occurred()) return NULL;
        if (first != CONF && first != SPEC) {
            PyErr_SetString(PyExc_ValueError, "kind must be 0, 1 or None");
            return NULL;
        }
    }
    for (long kind = first; b < t->n_backends && kind <= last; kind++) {
        lru_t *l = list_of(t, b, (uint32_t)kind);
        while (l->head != NIL) entry_free(t, l->head);
    }
    Py_RETURN_NONE;
}

/* dropped(backend, keys, confirmed): the speculative entries of keys go, and with
 * confirmed the confirmed ones too */
static PyObject *do_dropped(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t *keys;
    Py_ssize_t len;
    if (check_args(n, 3, "dropped") < 0 || as_backend(args[0], &b) < 0) return NULL;
    int confirmed = PyObject_IsTrue(args[2]);
    if (confirmed < 0 || (keys = u64s(args[1], &len)) == NULL) return NULL;
    for (Py_ssize_t i = 0; i < len && b < t->n_backends; i++) {
        for (uint32_t kind = confirmed ? CONF : SPEC; kind <= SPEC; kind++) {
            uint32_t e = kind_find(t, keys[i], b, kind);
            if (e != NIL) entry_free(t, e);
        }
    }
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

/* expire(now): every backend's speculative entries whose expiry passed go, oldest first
 * (each list is in expiry order while TTLs are equal); returns how many */
static PyObject *do_expire(Table *t, PyObject *now_obj) {
    double now = PyFloat_AsDouble(now_obj);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    long gone = 0;
    for (uint32_t b = 0; b < t->n_backends; b++) {
        lru_t *l = list_of(t, b, SPEC);
        while (l->head != NIL) {
            double at;
            memcpy(&at, &t->e_val[l->head], sizeof at);
            if (at > now) break;
            entry_free(t, l->head);
            gone++;
        }
    }
    return PyLong_FromLong(gone);
}

/* ---- reads ---- */

/* the largest m in [lo, hi] with keys[m - 1] held by backend (keys[:lo] are) */
static Py_ssize_t run(Table *t, PyObject **keys, uint32_t b, Py_ssize_t lo, Py_ssize_t hi) {
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        uint64_t key;
        if (as_u64(keys[mid - 1], &key) < 0) return -1;
        if (held(t, key, b)) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static inline int key_at(PyObject **keys, Py_ssize_t i, uint64_t *out) { return as_u64(keys[i], out); }

/* longest(keys, backend): how many leading blocks of keys the backend holds */
static PyObject *do_longest(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    if (check_args(n, 2, "longest") < 0 || as_backend(args[1], &b) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq), found = 0;
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    uint64_t first;
    if (len && b < t->n_backends) {
        if (key_at(keys, 0, &first) < 0) found = -1;
        else if (held(t, first, b)) found = run(t, keys, b, 1, len);
    }
    Py_DECREF(seq);
    return found < 0 ? NULL : PyLong_FromSsize_t(found);
}

/* the holders of a key whose chain starts at `e`, each backend once (a speculative entry
 * beside a confirmed one of its backend is not another holder), counted up to `most` + 1 */
static inline uint32_t holders_upto(Table *t, uint32_t e, uint32_t most) {
    uint32_t count = 0;
    for (; e != NIL && count <= most; e = t->e_hnext[e]) {
        uint32_t b = t->e_backend[e];
        if ((t->e_kind[e] & KIND) == CONF || kind_find(t, t->e_key[e], b, CONF) == NIL) count++;
    }
    return count;
}

static inline uint32_t holder_count(Table *t, uint64_t key, uint32_t most) {
    return holders_upto(t, key_find(t, key), most);
}

/* holders(keys, limit): [(backend, blocks held)] for the backends holding the longest
 * prefixes of keys: every holder of keys[0] when they are at most limit, else those
 * holding more blocks than the deepest level held by over limit (or limit of the holders
 * of the longest prefix, when that many tie on it), earliest holders first */
static PyObject *do_holders(Table *t, PyObject *const *args, Py_ssize_t n) {
    if (check_args(n, 2, "holders") < 0) return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(0), **keys = PySequence_Fast_ITEMS(seq);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    uint32_t *names = NULL;
    uint64_t key;
    if (out == NULL || len == 0 || limit <= 0) goto done;
    if (key_at(keys, 0, &key) < 0) goto fail;
    if (key_find(t, key) == NIL) goto done;
    Py_ssize_t lo = 1, hi = len; /* the deepest level some backend holds */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (key_at(keys, mid - 1, &key) < 0) goto fail;
        if (key_find(t, key) != NIL) lo = mid; else hi = mid - 1;
    }
    Py_ssize_t deepest = lo;
    uint32_t most = limit < UINT32_MAX - 1 ? (uint32_t)limit : UINT32_MAX - 1;
    lo = 0;
    hi = deepest - 1; /* the first level held by at most limit backends */
    if (key_at(keys, 0, &key) < 0) goto fail;
    if (holder_count(t, key, most) <= most) hi = 0;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (key_at(keys, mid, &key) < 0) goto fail;
        if (holder_count(t, key, most) <= most) hi = mid; else lo = mid + 1;
    }
    if (key_at(keys, lo, &key) < 0) goto fail;
    uint32_t head = key_find(t, key), count = 0, got = 0;
    for (uint32_t e = head; e != NIL; e = t->e_hnext[e]) count++;
    names = PyMem_Malloc(sizeof(uint32_t) * (count ? count : 1));
    if (names == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    /* the chain is newest first: a speculative entry beside a confirmed one of the same
     * backend is skipped, so each backend is named once */
    for (uint32_t e = head; e != NIL; e = t->e_hnext[e]) {
        uint32_t b = t->e_backend[e];
        if ((t->e_kind[e] & KIND) == SPEC && kind_find(t, key, b, CONF) != NIL) continue;
        names[got++] = b;
    }
    Py_ssize_t take = got < (uint64_t)limit ? got : limit;
    for (Py_ssize_t i = 0; i < take; i++) {
        uint32_t b = names[got - 1 - i];
        Py_ssize_t blocks = deepest;
        if (key_at(keys, deepest - 1, &key) < 0) goto fail;
        if (!held(t, key, b) && (blocks = run(t, keys, b, lo + 1, deepest - 1)) < 0) goto fail;
        PyObject *pair = Py_BuildValue("(In)", b, blocks);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
    }
done:
    PyMem_Free(names);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(names);
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* has(backend, key): the backend holds key, of either kind */
static PyObject *do_has(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t key;
    if (check_args(n, 2, "has") < 0 || as_backend(args[0], &b) < 0 || as_u64(args[1], &key) < 0)
        return NULL;
    return PyBool_FromLong(b < t->n_backends && held(t, key, b));
}

/* anywhere(key): some backend holds key */
static PyObject *do_anywhere(Table *t, PyObject *key_obj) {
    uint64_t key;
    if (as_u64(key_obj, &key) < 0) return NULL;
    return PyBool_FromLong(key_find(t, key) != NIL);
}

/* expiry(backend, key): when the backend's speculative entry for key expires, or None */
static PyObject *do_expiry(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t key;
    if (check_args(n, 2, "expiry") < 0 || as_backend(args[0], &b) < 0 || as_u64(args[1], &key) < 0)
        return NULL;
    uint32_t e = b < t->n_backends ? kind_find(t, key, b, SPEC) : NIL;
    if (e == NIL) Py_RETURN_NONE;
    double at;
    memcpy(&at, &t->e_val[e], sizeof at);
    return PyFloat_FromDouble(at);
}

/* key_of(backend, engine): the key of the block the backend reported as engine, or None */
static PyObject *do_key_of(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    uint64_t engine;
    if (check_args(n, 2, "key_of") < 0 || as_backend(args[0], &b) < 0 || as_u64(args[1], &engine) < 0)
        return NULL;
    uint32_t e = b < t->n_backends ? engine_find(t, engine, b) : NIL;
    if (e == NIL) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(t->e_key[e]);
}

/* size(backend): (confirmed, speculative) entries */
static PyObject *do_size(Table *t, PyObject *b_obj) {
    uint32_t b;
    if (as_backend(b_obj, &b) < 0) return NULL;
    if (b >= t->n_backends) return Py_BuildValue("(ii)", 0, 0);
    return Py_BuildValue("(II)", list_of(t, b, CONF)->len, list_of(t, b, SPEC)->len);
}

/* snapshot(backend, kind): its (key, engine hash) pairs if confirmed, (key, expiry) if
 * speculative, least recently used first */
static PyObject *do_snapshot(Table *t, PyObject *const *args, Py_ssize_t n) {
    uint32_t b;
    if (check_args(n, 2, "snapshot") < 0 || as_backend(args[0], &b) < 0) return NULL;
    long kind = PyLong_AsLong(args[1]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (kind != CONF && kind != SPEC) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 or 1");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL || b >= t->n_backends) return out;
    for (uint32_t e = list_of(t, b, (uint32_t)kind)->head; e != NIL; e = t->e_next[e]) {
        double at;
        memcpy(&at, &t->e_val[e], sizeof at);
        uint64_t key = t->e_key[e];
        PyObject *pair = kind == CONF ? Py_BuildValue("(KK)", key, t->e_val[e])
                                      : Py_BuildValue("(Kd)", key, at);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

/* member(name_hash): the id of the backend whose name hashes to name_hash (not 0), given
 * it now if it has none: the first free id */
static PyObject *do_member(Table *t, PyObject *h_obj) {
    uint64_t h;
    if (as_u64(h_obj, &h) < 0) return NULL;
    if (h == 0) {
        PyErr_SetString(PyExc_ValueError, "a name hash must not be 0");
        return NULL;
    }
    uint32_t id = NIL;
    for (uint32_t i = 0; i < t->n_named; i++) {
        if (t->b_name[i] == h) return PyLong_FromUnsignedLong(i);
        if (id == NIL && t->b_name[i] == 0) id = i;
    }
    if (id == NIL) {
        if (t->n_named >= MAX_BACKENDS) {
            PyErr_SetString(PyExc_OverflowError, "a table holds at most 65,535 backends");
            return NULL;
        }
        if (backends_grow(t, t->n_named) < 0) return PyErr_NoMemory();
        id = t->n_named++;
    }
    t->b_name[id] = h;
    return PyLong_FromUnsignedLong(id);
}

/* release(backend): its entries go, and its id is free for another name */
static PyObject *do_release(Table *t, PyObject *b_obj) {
    uint32_t b;
    if (as_backend(b_obj, &b) < 0) return NULL;
    for (uint32_t kind = CONF; b < t->n_backends && kind <= SPEC; kind++) {
        lru_t *l = list_of(t, b, kind);
        while (l->head != NIL) entry_free(t, l->head);
    }
    if (b < t->n_named) t->b_name[b] = 0;
    Py_RETURN_NONE;
}

/* the table with no entries and no keys (its names stay: other processes hold them) */
static void empty(Table *t) {
    t->e_top = t->e_live = t->k_live = 0;
    t->e_free = NIL;
    for (itab_t *it = &t->etab; it <= &t->ktab; it++) {
        memset(it->slot, EMPTY, sizeof(uint32_t) * ((size_t)it->mask + 1));
        it->used = 0;
        if (it->old != NULL) slots_free(t, it->old, sizeof(uint32_t) * ((size_t)it->old_mask + 1));
        it->old = NULL;
        it->old_used = 0;
    }
    for (uint32_t i = 0; i < t->n_backends * 2; i++) t->lru[i] = (lru_t){NIL, NIL, 0};
}

/* the shared state in this process's view: the arrays' offsets as addresses */
static void load(TableObject *o) {
    o->t = o->arena.header->state;
    for (size_t i = 0; i < sizeof ARRAYS / sizeof ARRAYS[0]; i++) {
        char **field = (char **)((char *)&o->t + ARRAYS[i]);
        if (*field != NULL) *field = o->arena.base + (uintptr_t)*field;
    }
    o->t.arena = &o->arena;
}

/* this process's view back into the shared state, a new version of it */
static void store(TableObject *o) {
    Table state = o->t;
    for (size_t i = 0; i < sizeof ARRAYS / sizeof ARRAYS[0]; i++) {
        char **field = (char **)((char *)&state + ARRAYS[i]);
        if (*field != NULL) *field = (char *)(uintptr_t)(*field - o->arena.base);
    }
    state.arena = NULL;
    o->arena.header->state = state;
    o->seen = ++o->arena.header->version;
}

/* take the shared table's lock and read its state (nothing to do for a private table) */
static int enter(TableObject *o) {
    if (o->arena.base == NULL || o->holding) return 0;
    header_t *h = o->arena.header;
    int err = pthread_mutex_trylock(&h->lock);
    if (err == EBUSY) { /* another process (or thread) holds it: wait without the GIL */
        Py_BEGIN_ALLOW_THREADS
        err = pthread_mutex_lock(&h->lock);
        Py_END_ALLOW_THREADS
    }
    if (err == EOWNERDEAD) {
        load(o);
        empty(&o->t);
        store(o);
        h->resets++;
        err = pthread_mutex_consistent(&h->lock);
    }
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (o->seen != h->version) {
        load(o);
        o->seen = h->version;
    }
    return 0;
}

/* let go of the lock, `wrote` having changed the table */
static void leave(TableObject *o, int wrote) {
    if (o->arena.base == NULL) return;
    if (wrote) store(o);
    if (!o->holding) pthread_mutex_unlock(&o->arena.header->lock);
}

/* hold(): keep the lock from here to the matching let_go, so that a run of calls (one
 * routing decision's) sees the table as no other process changes it meanwhile; nested
 * holds count. Nothing to hold for a private table. */
static PyObject *Table_hold(TableObject *o, PyObject *Py_UNUSED(arg)) {
    if (o->holding) {
        o->holding++;
        Py_RETURN_NONE;
    }
    if (enter(o) < 0) return NULL;
    if (o->arena.base != NULL) o->holding = 1;
    Py_RETURN_NONE;
}

static PyObject *Table_let_go(TableObject *o, PyObject *Py_UNUSED(arg)) {
    if (o->holding == 0) {
        if (o->arena.base == NULL) Py_RETURN_NONE;
        PyErr_SetString(PyExc_RuntimeError, "let_go() without hold()");
        return NULL;
    }
    if (--o->holding == 0) pthread_mutex_unlock(&o->arena.header->lock);
    Py_RETURN_NONE;
}

/* each method holds the lock around its work on the table */
#define LOCKED_FAST(name, wrote) \
    static PyObject *Table_##name(TableObject *o, PyObject *const *args, Py_ssize_t n) { \
        if (enter(o) < 0) return NULL; \
        PyObject *out = do_##name(&o->t, args, n); \
        leave(o, wrote); \
        return out; \
    }
/* a write that needs a growth the file system has no room for stops there, counted: the
 * keys before it are held (a shorter prefix, as an LRU would have left), the call goes on */
#define LOCKED_WRITE(name) \
    static PyObject *Table_##name(TableObject *o, PyObject *const *args, Py_ssize_t n) { \
        if (enter(o) < 0) return NULL; \
        PyObject *out = do_##name(&o->t, args, n); \
        if (out == NULL && o->arena.base != NULL && PyErr_ExceptionMatches(PyExc_MemoryError)) { \
            PyErr_Clear(); \
            o->arena.header->full++; \
            out = Py_NewRef(Py_None); \
        } \
        leave(o, 1); \
        return out; \
    }
#define LOCKED_ONE(name, wrote) \
    static PyObject *Table_##name(TableObject *o, PyObject *arg) { \
        if (enter(o) < 0) return NULL; \
        PyObject *out = do_##name(&o->t, arg); \
        leave(o, wrote); \
        return out; \
    }

LOCKED_WRITE(speculate)
LOCKED_FAST(touch, 1)
LOCKED_WRITE(confirm)
LOCKED_FAST(trim, 1)
LOCKED_FAST(removed, 1)
LOCKED_FAST(events, 1)
LOCKED_FAST(clear, 1)
LOCKED_FAST(dropped, 1)
LOCKED_FAST(longest, 0)
LOCKED_FAST(holders, 0)
LOCKED_FAST(has, 0)
LOCKED_FAST(expiry, 0)
LOCKED_FAST(key_of, 0)
LOCKED_FAST(snapshot, 0)
LOCKED_ONE(expire, 1)
LOCKED_ONE(anywhere, 0)
LOCKED_ONE(size, 0)
LOCKED_ONE(member, 1)
LOCKED_ONE(release, 1)

/* a number of the table, read under its lock; -1 with an exception set */
static Py_ssize_t counted(TableObject *o, int entries) {
    if (enter(o) < 0) return -1;
    Py_ssize_t n = entries ? o->t.e_live : o->t.k_live;
    leave(o, 0);
    return n;
}

static Py_ssize_t Table_len(TableObject *o) { return counted(o, 0); }

static PyObject *Table_get_entries(TableObject *o, void *Py_UNUSED(closure)) {
    Py_ssize_t n = counted(o, 1);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

/* an id table's slots, the old ones too while it grows */
static inline size_t slots(const itab_t *it) {
    return (size_t)it->mask + 1 + (it->old == NULL ? 0 : (size_t)it->old_mask + 1);
}

/* bytes allocated for the arrays and tables */
static PyObject *Table_get_nbytes(TableObject *o, void *Py_UNUSED(closure)) {
    if (enter(o) < 0) return NULL;
    Table *t = &o->t;
    size_t per_entry = 8 + 8 + 4 + 4 + 4 + 2 + 1;
    size_t bytes = per_entry * t->e_cap +
                   (sizeof(lru_t) * 2 + sizeof(uint64_t)) * t->n_backends +
                   sizeof(uint32_t) * (slots(&t->etab) + slots(&t->gtab) + slots(&t->ktab));
    leave(o, 0);
    return PyLong_FromSize_t(bytes);
}

static PyObject *Table_get_shared(TableObject *o, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(o->arena.base != NULL);
}

static PyObject *Table_get_resets(TableObject *o, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(o->arena.base == NULL ? 0 : o->arena.header->resets);
}

static PyObject *Table_get_full(TableObject *o, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(o->arena.base == NULL ? 0 : o->arena.header->full);
}

/* a table with its id tables and nothing in them */
static int fresh(Table *t) {
    t->e_free = NIL;
    if (itab_init(t, &t->etab, 1024) < 0 || itab_init(t, &t->gtab, 1024) < 0 ||
        itab_init(t, &t->ktab, 1024) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* the header of a file no process has set up yet: its lock, its arena, an empty table */
static int set_up(TableObject *o) {
    header_t *h = o->arena.header;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    int err = pthread_mutex_init(&h->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    h->top = pages(sizeof(header_t));
    h->resets = h->full = 0;
    memset(&o->t, 0, sizeof o->t);
    o->t.arena = &o->arena;
    if (fresh(&o->t) < 0) return -1;
    store(o);
    h->magic = MAGIC;
    return 0;
}

/* map the table's file at path, setting it up if this process is the first (the file's
 * flock keeps two first processes apart) */
static int open_shared(TableObject *o, PyObject *path) {
    const char *name = PyBytes_AS_STRING(path);
    int fd = open(name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        return -1;
    }
    struct stat st;
    void *base = MAP_FAILED;
    if (flock(fd, LOCK_EX) < 0 || fstat(fd, &st) < 0 ||
        ((uint64_t)st.st_size < ARENA_BYTES && ftruncate(fd, (off_t)ARENA_BYTES) < 0) ||
        (base = mmap(NULL, ARENA_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0)) ==
            MAP_FAILED) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        close(fd);
        return -1;
    }
    o->arena = (arena_t){base, fd, base};
    uint64_t magic = o->arena.header->magic;
    int ok = magic == MAGIC ? 0 : magic == 0 ? set_up(o) : -1;
    flock(fd, LOCK_UN);
    if (ok < 0 && magic != 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_OSError, "%R holds a table of another layout (another kvroute version)",
                     path);
    return ok;
}

static int Table_init(TableObject *o, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", NULL};
    PyObject *path = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O&:BlockTable", kwlist, PyUnicode_FSConverter, &path))
        return -1;
    if (o->arena.base != NULL || o->t.etab.slot != NULL) {
        Py_XDECREF(path);
        PyErr_SetString(PyExc_TypeError, "a BlockTable is set up once");
        return -1;
    }
    int ok = path == NULL ? fresh(&o->t) : open_shared(o, path);
    Py_XDECREF(path);
    return ok;
}

static void Table_dealloc(TableObject *o) {
    Table *t = &o->t;
    if (o->arena.base != NULL) {
        munmap(o->arena.base, ARENA_BYTES);
        close(o->arena.fd);
    } else {
#define FREE_IDS(arr, n) map_free((arr), sizeof(*(arr)) * (size_t)(n))
        FREE_IDS(t->e_key, t->e_cap);
        FREE_IDS(t->e_val, t->e_cap);
        FREE_IDS(t->e_prev, t->e_cap);
        FREE_IDS(t->e_next, t->e_cap);
        FREE_IDS(t->e_hnext, t->e_cap);
        FREE_IDS(t->e_backend, t->e_cap);
        FREE_IDS(t->e_kind, t->e_cap);
#undef FREE_IDS
        for (itab_t *it = &t->etab; it <= &t->ktab; it++) {
            map_free(it->slot, sizeof(uint32_t) * ((size_t)it->mask + 1));
            map_free(it->old, sizeof(uint32_t) * ((size_t)it->old_mask + 1));
        }
        PyMem_RawFree(t->lru);
        PyMem_RawFree(t->b_name);
    }
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyMethodDef Table_methods[] = {
    {"speculate", (PyCFunction)(void (*)(void))Table_speculate, METH_FASTCALL, NULL},
    {"touch", (PyCFunction)(void (*)(void))Table_touch, METH_FASTCALL, NULL},
    {"confirm", (PyCFunction)(void (*)(void))Table_confirm, METH_FASTCALL, NULL},
    {"trim", (PyCFunction)(void (*)(void))Table_trim, METH_FASTCALL, NULL},
    {"removed", (PyCFunction)(void (*)(void))Table_removed, METH_FASTCALL, NULL},
    {"events", (PyCFunction)(void (*)(void))Table_events, METH_FASTCALL, NULL},
    {"clear", (PyCFunction)(void (*)(void))Table_clear, METH_FASTCALL, NULL},
    {"dropped", (PyCFunction)(void (*)(void))Table_dropped, METH_FASTCALL, NULL},
    {"expire", (PyCFunction)Table_expire, METH_O, NULL},
    {"longest", (PyCFunction)(void (*)(void))Table_longest, METH_FASTCALL, NULL},
    {"holders", (PyCFunction)(void (*)(void))Table_holders, METH_FASTCALL, NULL},
    {"has", (PyCFunction)(void (*)(void))Table_has, METH_FASTCALL, NULL},
    {"anywhere", (PyCFunction)Table_anywhere, METH_O, NULL},
    {"expiry", (PyCFunction)(void (*)(void))Table_expiry, METH_FASTCALL, NULL},
    {"key_of", (PyCFunction)(void (*)(void))Table_key_of, METH_FASTCALL, NULL},
    {"size", (PyCFunction)Table_size, METH_O, NULL},
    {"member", (PyCFunction)Table_member, METH_O, NULL},
    {"hold", (PyCFunction)Table_hold, METH_NOARGS, NULL},
    {"let_go", (PyCFunction)Table_let_go, METH_NOARGS, NULL},
    {"release", (PyCFunction)Table_release, METH_O, NULL},
    {"snapshot", (PyCFunction)(void (*)(void))Table_snapshot, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Table_getset[] = {
    {"entries", (getter)Table_get_entries, NULL, "(key, backend, kind) entries held", NULL},
    {"nbytes", (getter)Table_get_nbytes, NULL, "bytes allocated for the table", NULL},
    {"shared", (getter)Table_get_shared, NULL, "whether the table is in a shared file", NULL},
    {"resets", (getter)Table_get_resets, NULL, "times a process died holding the lock", NULL},
    {"full", (getter)Table_get_full, NULL, "writes cut short: no room in the file system", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hashing._block_table.BlockTable",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Every backend's block keys on one cache medium, in flat arrays.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_as_sequence = &Table_as_sequence,
};

/* chain(parent, packed, block_size): the chained keys of the full blocks of token ids
 * packed as little-endian uint32s (hashing/blocks.py `chain_packed`), each block's XXH3
 * seeded with the key before it (`parent` for the first); for HASHES_STORES only */
static PyObject *module_chain(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t n) {
    uint64_t parent;
    Py_buffer view;
    if (check_args(n, 3, "chain") < 0 || as_u64(args[0], &parent) < 0) return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size <= 0 || xxh3_seeded == NULL) {
        PyErr_SetString(PyExc_ValueError, "chain needs a positive block size and XXH3");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return NULL;
    size_t step = sizeof(uint32_t) * (size_t)block_size;
    Py_ssize_t blocks = view.len / (Py_ssize_t)step;
    PyObject *keys = PyList_New(blocks);
    for (Py_ssize_t j = 0; keys != NULL && j < blocks; j++) {
        parent = xxh3_seeded((const char *)view.buf + (size_t)j * step, step, parent);
        PyObject *key = PyLong_FromUnsignedLongLong(parent);
        if (key == NULL) Py_CLEAR(keys);
        else PyList_SET_ITEM(keys, j, key);
    }
    PyBuffer_Release(&view);
    return keys;
}

static PyMethodDef module_methods[] = {
    {"chain", (PyCFunction)(void (*)(void))module_chain, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_table", NULL, -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__block_table(void) {
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject **names[] = {&s_medium, &s_block_hashes, &s_token_ids, &s_block_size,
                          &s_parent, &s_lora, &s_extra};
    const char *spelled[] = {"medium", "block_hashes", "token_ids", "block_size",
                             "parent_block_hash", "lora_name", "extra_keys"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i] = PyUnicode_InternFromString(spelled[i])) == NULL) return NULL;
    find_xxh3();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&TableType) < 0 ||
        PyModule_AddObjectRef(m, "HASHES_STORES", xxh3_seeded ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
