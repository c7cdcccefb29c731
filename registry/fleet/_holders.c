/* The fleet view's holder maps at native speed (registry.fleet.holders, .matches).
 *
 * ``Index``: block hash -> holder int, an open-addressing table of (uint64 hash, object)
 * pairs side by side, kept equal to the table's dict of the same (the dict stays the
 * truth the rest of the package reads). A lookup is one probe into one array, where a
 * dict of int keys reads its index, its entries and the stored key object: on a fleet
 * of a million blocks and more, each of those reads is a cache miss.
 *
 * ``change``: what registry.fleet.holders.HolderTable._change does, one namespace's bit
 * set for the hashes added and cleared for those removed, in the dict and the index at
 * once (a hash one namespace alone holds points at that slot's one shared int).
 *
 * ``walk``: a prompt's hashes looked up one after another and the running holder set
 * narrowed by each, until no namespace of the mask still holds every block so far;
 * what comes back is the running sets' change points (the prefix length at which each
 * holder set ends), which is all an answer is made of. Narrowing makes no new int
 * where the set does not change, which is nearly every block: a chain's blocks are held
 * by the same namespaces one after another, so a block whose holder int is the previous
 * block's (the same object, or equal) leaves the running set as it was. Hashes are
 * checked as they are read (exact ints in [1, 2^63-1]; -1 and 0 end the prompt, as a
 * sentinel does); anything else hands the prompt back to the Python walk, which raises
 * the clear error.
 *
 * The module is an optional speed-up: registry.fleet.matches and .holders are the
 * specification and the fallback, with equal answers. Written for this project; no
 * code from elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define EMPTY 0ULL                 /* hashes are in [1, 2^63-1]: 0 is never one */
#define GONE 0x8000000000000000ULL /* a removed entry (2^63: never a hash either) */
#define MIN_SLOTS 64

typedef struct {
    uint64_t key;
    PyObject *value; /* owned */
} Slot;

typedef struct {
    PyObject_HEAD Slot *slots;
    size_t mask;   /* slots - 1 (a power of two) */
    size_t used;   /* live entries */
    size_t filled; /* live and removed entries */
} Index;

static PyTypeObject IndexType;

static inline size_t spread(uint64_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> 17); }

/* Ask for the cache line of a hash's first probe ahead of time: a prompt's hashes are
 * known before the walk reaches them, so their table reads (each a cache miss on a
 * large fleet) overlap instead of following one another. */
#define AHEAD 8

static inline void prefetch(const Index *ix, PyObject *h) {
    if (!PyLong_CheckExact(h)) return;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (overflow || value < 1) {
        PyErr_Clear();
        return;
    }
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&ix->slots[spread((uint64_t)value) & ix->mask]);
#else
    (void)ix;
#endif
}

static Slot *find(const Index *ix, uint64_t key) {
    size_t at = spread(key) & ix->mask;
    for (;;) {
        Slot *slot = &ix->slots[at];
        if (slot->key == key) return slot;
        if (slot->key == EMPTY) return NULL;
        at = (at + 1) & ix->mask;
    }
}

static int resize(Index *ix, size_t size) {
    Slot *slots = PyMem_Calloc(size, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = ix->slots;
    size_t count = old == NULL ? 0 : ix->mask + 1;
    for (size_t i = 0; i < count; i++) {
        if (old[i].key == EMPTY || old[i].key == GONE) continue;
        size_t at = spread(old[i].key) & (size - 1);
        while (slots[at].key != EMPTY) at = (at + 1) & (size - 1);
        slots[at] = old[i];
    }
    PyMem_Free(old);
    ix->slots = slots;
    ix->mask = size - 1;
    ix->filled = ix->used;
    return 0;
}

/* Set key -> value (a new reference taken). */
static int put(Index *ix, uint64_t key, PyObject *value) {
    if ((ix->filled + 1) * 4 > (ix->mask + 1) * 3) { /* past three quarters: grow or clean */
        size_t size = ix->mask + 1;
        while ((ix->used + 1) * 2 > size) size *= 2;
        if (resize(ix, size) < 0) return -1;
    }
    size_t at = spread(key) & ix->mask;
    Slot *gone = NULL;
    for (;;) {
        Slot *slot = &ix->slots[at];
        if (slot->key == key) {
            Py_INCREF(value);
            Py_SETREF(slot->value, value);
            return 0;
        }
        if (slot->key == GONE && gone == NULL) gone = slot;
        if (slot->key == EMPTY) {
            if (gone == NULL) {
                gone = slot;
                ix->filled++;
            }
            gone->key = key;
            Py_INCREF(value);
            gone->value = value;
            ix->used++;
            return 0;
        }
        at = (at + 1) & ix->mask;
    }
}

static void drop(Index *ix, uint64_t key) {
    Slot *slot = find(ix, key);
    if (slot == NULL) return;
    slot->key = GONE;
    Py_CLEAR(slot->value);
    ix->used--;
}

/* A hash as the table's key, or 0 where it is not one (an exact int in [1, 2^63-1]). */
static uint64_t key_of(PyObject *h) {
    if (!PyLong_CheckExact(h)) return 0;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (overflow || value < 1) {
        PyErr_Clear();
        return 0;
    }
    return (uint64_t)value;
}

static PyObject *index_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Index() takes no arguments");
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (ix == NULL) return NULL;
    if (resize(ix, MIN_SLOTS) < 0) {
        Py_DECREF(ix);
        return NULL;
    }
    return (PyObject *)ix;
}

static void index_dealloc(Index *ix) {
    if (ix->slots != NULL) {
        for (size_t i = 0; i <= ix->mask; i++) Py_XDECREF(ix->slots[i].value);
        PyMem_Free(ix->slots);
    }
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static Py_ssize_t index_len(Index *ix) { return (Py_ssize_t)ix->used; }

static PyObject *index_items(Index *ix, PyObject *unused) {
    (void)unused;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    for (size_t i = 0; i <= ix->mask; i++) {
        Slot *slot = &ix->slots[i];
        if (slot->key == EMPTY || slot->key == GONE) continue;
        PyObject *key = PyLong_FromUnsignedLongLong(slot->key);
        if (key == NULL || PyDict_SetItem(out, key, slot->value) < 0) {
            Py_XDECREF(key);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
    }
    return out;
}

static PyMethodDef index_methods[] = {
    {"as_dict", (PyCFunction)index_items, METH_NOARGS, "Every entry, as a new dict."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods index_as_sequence = {.sq_length = (lenfunc)index_len};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "registry.fleet._holders.Index",
    .tp_basicsize = sizeof(Index),
    .tp_dealloc = (destructor)index_dealloc,
    .tp_as_sequence = &index_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block hash -> holder int, kept equal to the table's dict by change().",
    .tp_methods = index_methods,
    .tp_new = index_new,
};

/* The holder ints one change() made, by the int each replaced: the blocks of a chain
 * held by the same namespaces hold the same int before a change, so they share one
 * after it too (fewer objects, and a walk along them compares pointers). Strong
 * references, so no address is reused while the call runs. */
#define MEMO 8
typedef struct {
    PyObject *from[MEMO], *to[MEMO];
    int size, next;
} Memo;

static PyObject *recalled(Memo *memo, PyObject *from) {
    for (int i = 0; i < memo->size; i++)
        if (memo->from[i] == from) {
            Py_INCREF(memo->to[i]);
            return memo->to[i];
        }
    return NULL;
}

static void remember(Memo *memo, PyObject *from, PyObject *to) {
    int at;
    if (memo->size < MEMO) {
        at = memo->size++;
    } else { /* the oldest goes */
        at = memo->next;
        memo->next = (memo->next + 1) % MEMO;
        Py_DECREF(memo->from[at]);
        Py_DECREF(memo->to[at]);
    }
    Py_INCREF(from);
    Py_INCREF(to);
    memo->from[at] = from;
    memo->to[at] = to;
}

static void forget(Memo *memo) {
    for (int i = 0; i < memo->size; i++) {
        Py_DECREF(memo->from[i]);
        Py_DECREF(memo->to[i]);
    }
    memo->size = memo->next = 0;
}

/* change(blocks, index, added, removed, bit, shared): set `bit` for every hash of
 * `added`, clear it for every hash of `removed`, in `blocks` and `index` alike. */
static PyObject *change(PyObject *self, PyObject *args) {
    PyObject *blocks, *added, *removed, *bit, *shared;
    Index *ix;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!OOO!O!", &PyDict_Type, &blocks, &IndexType, &ix, &added,
                          &removed, &PyLong_Type, &bit, &PyList_Type, &shared))
        return NULL;
    Memo memo = {.size = 0, .next = 0};
    PyObject *it = PyObject_GetIter(added), *h;
    if (it == NULL) return NULL;
    while ((h = PyIter_Next(it)) != NULL) {
        uint64_t key = key_of(h);
        if (!key) {
            PyErr_SetString(PyExc_ValueError, "a block hash must be an int in [1, 2^63-1]");
            goto failed;
        }
        PyObject *value = PyDict_GetItemWithError(blocks, h); /* borrowed */
        PyObject *now;
        if (value == NULL) {
            if (PyErr_Occurred()) goto failed;
            now = bit;
            Py_INCREF(now);
        } else if ((now = recalled(&memo, value)) == NULL) {
            if ((now = PyNumber_Or(value, bit)) == NULL) goto failed;
            remember(&memo, value, now);
        }
        int bad = PyDict_SetItem(blocks, h, now) < 0 || put(ix, key, now) < 0;
        Py_DECREF(now);
        if (bad) goto failed;
        Py_DECREF(h);
    }
    Py_DECREF(it);
    forget(&memo);
    if (PyErr_Occurred()) return NULL;

    PyObject *inverse = PyNumber_Invert(bit), *one = PyLong_FromLong(1);
    if (inverse == NULL || one == NULL) {
        Py_XDECREF(inverse);
        Py_XDECREF(one);
        return NULL;
    }
    it = PyObject_GetIter(removed);
    if (it == NULL) goto cleared;
    while ((h = PyIter_Next(it)) != NULL) {
        PyObject *value = PyDict_GetItemWithError(blocks, h); /* borrowed */
        if (value == NULL) {
            Py_DECREF(h);
            if (PyErr_Occurred()) break;
            continue;
        }
        uint64_t key = key_of(h);
        PyObject *now = recalled(&memo, value);
        int bad = 0;
        if (now != NULL) {
            bad = PyDict_SetItem(blocks, h, now) < 0 || (key && put(ix, key, now) < 0);
            Py_DECREF(now);
            Py_DECREF(h);
            if (bad) break;
            continue;
        }
        if ((now = PyNumber_And(value, inverse)) == NULL) {
            Py_DECREF(h);
            break;
        }
        int truth = PyObject_IsTrue(now);
        bad = truth < 0;
        if (!bad && !truth) {
            bad = PyDict_DelItem(blocks, h) < 0;
            if (!bad && key) drop(ix, key);
        } else if (!bad) {
            /* one holder left: its shared int (bit_length - 1 is its slot) */
            PyObject *less = PyNumber_Subtract(now, one), *both = NULL;
            bad = less == NULL || (both = PyNumber_And(now, less)) == NULL;
            int lone = bad ? 0 : !PyObject_IsTrue(both);
            Py_XDECREF(less);
            Py_XDECREF(both);
            if (!bad && lone) {
                PyObject *length = PyObject_CallMethod(now, "bit_length", NULL);
                Py_ssize_t at = length == NULL ? -1 : PyLong_AsSsize_t(length) - 1;
                Py_XDECREF(length);
                if (at < 0 || at >= PyList_GET_SIZE(shared)) {
                    bad = 1;
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_IndexError, "a slot without its shared int");
                } else {
                    PyObject *one_bit = PyList_GET_ITEM(shared, at);
                    Py_INCREF(one_bit);
                    Py_SETREF(now, one_bit);
                }
            }
            if (!bad) {
                remember(&memo, value, now); /* value is still alive: the memo holds it */
                bad = PyDict_SetItem(blocks, h, now) < 0 || (key && put(ix, key, now) < 0);
            }
        }
        Py_DECREF(now);
        Py_DECREF(h);
        if (bad) break;
    }
    Py_DECREF(it);
cleared:
    forget(&memo);
    Py_DECREF(inverse);
    Py_DECREF(one);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;

failed:
    forget(&memo);
    Py_DECREF(h);
    Py_DECREF(it);
    return NULL;
}

/* One change point: (the prefix length, the slots whose prefix ends there). */
static int append_step(PyObject *steps, Py_ssize_t position, PyObject *bits) {
    PyObject *at = PyLong_FromSsize_t(position);
    if (at == NULL) return -1;
    PyObject *pair = PyTuple_Pack(2, at, bits);
    Py_DECREF(at);
    if (pair == NULL) return -1;
    int failed = PyList_Append(steps, pair);
    Py_DECREF(pair);
    return failed;
}

/* walk(index, hashes, mask, mamba) -> (steps, marks, read), or None to hand the
 * prompt back to the Python walk (a hash that is not an exact int in range). */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *hashes, *mask, *mamba;
    Index *ix;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!O", &IndexType, &ix, &PyList_Type, &hashes, &PyLong_Type,
                          &mask, &mamba))
        return NULL;
    if (mamba != Py_None && !PyObject_TypeCheck(mamba, &IndexType)) {
        PyErr_SetString(PyExc_TypeError, "mamba must be an Index or None");
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    PyObject *steps = PyList_New(0);
    PyObject *marks = PyList_New(0);
    PyObject *running = mask;
    /* Strong references, both: a decision may pause (a collection that runs a finalizer
     * lets another thread in) while the follower replaces these ints in the index. */
    PyObject *last = NULL;    /* the previous block's holder int */
    PyObject *holders = NULL; /* this block's */
    Py_ssize_t read = 0;
    int truth;
    Py_INCREF(running);
    if (zero == NULL || steps == NULL || marks == NULL) goto fail;
    truth = PyObject_IsTrue(running);
    if (truth < 0) goto fail;
    if (!truth) goto done; /* nothing live: the caller checks every hash */

    Py_ssize_t n = PyList_GET_SIZE(hashes);
    Py_ssize_t i;
    for (i = 0; i < n && i < AHEAD; i++) prefetch(ix, PyList_GET_ITEM(hashes, i));
    for (i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch(ix, PyList_GET_ITEM(hashes, i + AHEAD));
        PyObject *h = PyList_GET_ITEM(hashes, i);
        if (!PyLong_CheckExact(h)) goto slow;
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(h, &overflow);
        if (overflow || (value == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            goto slow;
        }
        if (value < -1) goto slow;
        read = i + 1;
        Slot *slot = value > 0 ? find(ix, (uint64_t)value) : NULL;
        if (slot == NULL) { /* no one holds it (or a sentinel): every prefix ends here */
            if (i > 0 && append_step(steps, i, running) < 0) goto fail;
            break;
        }
        holders = slot->value;
        Py_INCREF(holders);
        if (holders != running && holders != last) {
            int same = last == NULL ? 0 : PyObject_RichCompareBool(holders, last, Py_EQ);
            if (same < 0) goto fail;
            if (!same) {
                PyObject *narrowed = PyNumber_And(running, holders);
                if (narrowed == NULL) goto fail;
                int kept = PyObject_RichCompareBool(narrowed, running, Py_EQ);
                if (kept < 0) {
                    Py_DECREF(narrowed);
                    goto fail;
                }
                if (!kept) {
                    PyObject *left = PyNumber_Xor(running, narrowed);
                    if (left == NULL) {
                        Py_DECREF(narrowed);
                        goto fail;
                    }
                    int failed = i > 0 ? append_step(steps, i, left) : 0;
                    Py_DECREF(left);
                    if (failed < 0) {
                        Py_DECREF(narrowed);
                        goto fail;
                    }
                    truth = PyObject_IsTrue(narrowed);
                    if (truth <= 0) {
                        Py_DECREF(narrowed);
                        if (truth < 0) goto fail;
                        Py_CLEAR(holders);
                        break;
                    }
                    /* Running on the holders' own int where they are all of it: the
                     * next blocks of a lone holder are then the same object. */
                    int whole = PyObject_RichCompareBool(narrowed, holders, Py_EQ);
                    if (whole < 0) {
                        Py_DECREF(narrowed);
                        goto fail;
                    }
                    if (whole) {
                        Py_INCREF(holders);
                        Py_SETREF(narrowed, holders);
                    }
                    Py_SETREF(running, narrowed);
                } else {
                    Py_DECREF(narrowed);
                }
            }
        }
        Py_XSETREF(last, holders); /* the reference moves to last */
        holders = NULL;
        if (mamba != Py_None) {
            Slot *held = find((Index *)mamba, (uint64_t)value);
            PyObject *mark;
            if (held == NULL) {
                mark = zero;
                Py_INCREF(mark);
            } else if ((mark = PyNumber_And(held->value, running)) == NULL) {
                goto fail;
            }
            int failed = PyList_Append(marks, mark);
            Py_DECREF(mark);
            if (failed < 0) goto fail;
        }
    }
    if (i == n && n > 0 && append_step(steps, n, running) < 0) goto fail;

done:
    Py_XDECREF(last);
    Py_DECREF(running);
    Py_DECREF(zero);
    return Py_BuildValue("(NNn)", steps, marks, read);

slow:
    Py_XDECREF(last);
    Py_DECREF(running);
    Py_XDECREF(zero);
    Py_XDECREF(steps);
    Py_XDECREF(marks);
    Py_RETURN_NONE;

fail:
    Py_XDECREF(holders);
    Py_XDECREF(last);
    Py_DECREF(running);
    Py_XDECREF(zero);
    Py_XDECREF(steps);
    Py_XDECREF(marks);
    return NULL;
}

static PyMethodDef methods[] = {
    {"change", change, METH_VARARGS,
     "change(blocks, index, added, removed, bit, shared): HolderTable._change in the dict "
     "and the index at once."},
    {"walk", walk, METH_VARARGS,
     "walk(index, hashes, mask, mamba) -> (steps, marks, read), or None for the "
     "Python walk: registry.fleet.matches.walk at native speed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_holders",
    "The fleet view's holder maps at native speed (registry.fleet.holders).", -1, methods,
};

PyMODINIT_FUNC PyInit__holders(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
