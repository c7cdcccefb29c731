/* The balance rule's arithmetic (registry.routing.balance.Weighed) in C: each candidate's
 * load read once into a row, then costed and ordered for any prefixes. The same doubles
 * in the same order of operations as the Python it replaces (compiled without contracting
 * a multiply and an add into one rounding), so every cost is bit-identical; the Python
 * runs instead wherever an input is not of the exact types this reads (NotImplemented).
 *
 * rows(names, prompt_tokens, loads, now, half_life, request_tokens, kv_usage_limit,
 *      queue_weight, kinned, sent, affinity_bound, load_type, decayed_type)
 *   (kinned and sent: numbers, or Decayed sums read as of now)
 *   -> (rows, kin_terms) | NotImplemented
 * costed(rows, kin_terms, prompt_tokens, cached, kv, spread_weight, affinity_weight,
 *        checkpoint_weight, leader, choice)
 *   -> the rows costed and ordered, each as choice(name, cost, hit, queued, share) or,
 *      with choice None, as (cost, in_flight, name, hit, queued, share); with leader the
 *      first one's name alone | NotImplemented
 * decide(backends, steps, slots, pending, far, hashes, at, prompt_tokens, block_size,
 *        now, rule, kinned, sent, tell, load_type, decayed_type, choice, reach)
 *   the gateway's usual decision in one call (pcr.gateway.state.GatewayState.choose with
 *   the fleet view and no hybrid node): each backend's prefix from the view's walk
 *   (steps: [(blocks, slot bits)], slots: namespace -> slot), continued through its
 *   pending blocks (pending: namespace -> an object whose ``kv`` maps hash -> an entry
 *   pending while ``refs`` or ``until > at``) and the other replicas' chains (far:
 *   namespace -> an object with ``positions``, farthest first, and ``anchors``: hash ->
 *   (position, held offset, checkpoint)), as pcr.gateway.pending's ``extend`` does, in
 *   whole blocks of tokens never the last one, then rows and costed as above
 *   -> (choices ranked, each with reach set on the two best; whether any backend has a
 *      prefix; whether the pending blocks changed the leader, asked only with ``tell``)
 *      | NotImplemented
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static PyObject *s_in_flight, *s_remote_in_flight, *s_pending, *s_remote_pending,
    *s_recent, *s_remote_recent, *s_remote_at, *s_engine_requests, *s_kv_usage, *s_value,
    *s_at, *s_namespace, *s_load, *s_kv, *s_refs, *s_until, *s_reach, *s_half_life,
    *s_request_tokens, *s_kv_usage_limit, *s_queue_weight, *s_affinity_bound,
    *s_spread_weight, *s_affinity_weight, *s_checkpoint_weight, *s_positions, *s_anchors;

/* A number (exact float or int) as a double; 1 for anything else. */
static int
as_double(PyObject *value, double *out)
{
    if (PyFloat_CheckExact(value)) {
        *out = PyFloat_AS_DOUBLE(value);
        return 0;
    }
    if (PyLong_CheckExact(value)) {
        *out = PyLong_AsDouble(value);
        if (*out == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        return 0;
    }
    return 1;
}

/* An exact int as a long long; 1 for anything else or out of range. */
static int
as_long(PyObject *value, long long *out)
{
    if (!PyLong_CheckExact(value))
        return 1;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* A number attribute as a double; -1 with an exception, 1 when it is another type. */
static int
number_attr(PyObject *obj, PyObject *name, double *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int status = as_double(value, out);
    Py_DECREF(value);
    return status;
}

/* An exact int attribute as a long long; -1 with an exception, 1 for another type or
   one out of range. */
static int
int_attr(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int status = as_long(value, out);
    Py_DECREF(value);
    return status;
}

/* A kin count as a double: a number, or a Decayed sum (registry.routing.balance.Kin.sums)
   as of now, as balance.decayed reads it; -1 with an exception, 1 for another type. */
static int
kin_count(PyObject *count, PyObject *decayed_type, double now, double half_life, double *out)
{
    if ((PyObject *)Py_TYPE(count) != decayed_type)
        return as_double(count, out);
    double value, at;
    int status = number_attr(count, s_value, &value);
    if (!status)
        status = number_attr(count, s_at, &at);
    if (status)
        return status;
    *out = value != 0.0 && now > at ? value * pow(0.5, (now - at) / half_life) : value;
    return 0;
}

typedef struct {
    long long in_flight;
    double queued, recent;
    int full;
} Loaded;

#define FALLBACK(cleanup) \
    do { cleanup; Py_RETURN_NOTIMPLEMENTED; } while (0)

static PyObject *
weigh_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "rows takes 13 arguments");
        return NULL;
    }
    PyObject *names = args[0], *loads = args[2], *kinned = args[8], *sent = args[9];
    PyObject *load_type = args[11], *decayed_type = args[12];
    long long prompt_tokens;
    double now, half_life, request_tokens, kv_usage_limit, queue_weight, affinity_bound;
    if (!PyDict_CheckExact(names) || !PyDict_CheckExact(loads))
        Py_RETURN_NOTIMPLEMENTED;
    if (as_long(args[1], &prompt_tokens) || as_double(args[3], &now)
        || as_double(args[4], &half_life) || as_double(args[5], &request_tokens)
        || as_double(args[6], &kv_usage_limit) || as_double(args[7], &queue_weight)
        || as_double(args[10], &affinity_bound))
        Py_RETURN_NOTIMPLEMENTED;
    if (prompt_tokens > (1LL << 40) || prompt_tokens < -(1LL << 40))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t count = PyDict_GET_SIZE(names);
    Loaded *loaded = PyMem_Malloc(sizeof(Loaded) * (count ? count : 1));
    if (loaded == NULL)
        return PyErr_NoMemory();
    double total = 0.0;
    Py_ssize_t pos = 0, i = 0;
    PyObject *name, *ignored;
    while (PyDict_Next(names, &pos, &name, &ignored)) {
        Loaded *row = &loaded[i++];
        PyObject *load = PyDict_GetItemWithError(loads, name);  /* borrowed */
        if (load == NULL) {
            if (PyErr_Occurred())
                FALLBACK(PyErr_Clear(); PyMem_Free(loaded));
            row->in_flight = 0;
            row->queued = 0.0;
            row->recent = 0.0;
            row->full = 0;
            continue;
        }
        if ((PyObject *)Py_TYPE(load) != load_type)
            FALLBACK(PyMem_Free(loaded));
        PyObject *decayed = PyObject_GetAttr(load, s_recent);
        if (decayed == NULL)
            FALLBACK(PyErr_Clear(); PyMem_Free(loaded));
        if ((PyObject *)Py_TYPE(decayed) != decayed_type)
            FALLBACK(Py_DECREF(decayed); PyMem_Free(loaded));
        double value, at, remote, remote_at, pending, remote_pending, engine_requests, kv_usage;
        long long own, others;
        int status = number_attr(decayed, s_value, &value);
        if (!status)
            status = number_attr(decayed, s_at, &at);
        Py_DECREF(decayed);
        if (!status)
            status = number_attr(load, s_remote_recent, &remote);
        if (!status)
            status = number_attr(load, s_remote_at, &remote_at);
        if (!status)
            status = int_attr(load, s_in_flight, &own);
        if (!status)
            status = int_attr(load, s_remote_in_flight, &others);
        if (!status)
            status = number_attr(load, s_pending, &pending);
        if (!status)
            status = number_attr(load, s_remote_pending, &remote_pending);
        if (!status)
            status = number_attr(load, s_engine_requests, &engine_requests);
        if (!status)
            status = number_attr(load, s_kv_usage, &kv_usage);
        if (status < 0)
            FALLBACK(PyErr_Clear(); PyMem_Free(loaded));
        if (status > 0 || own > (1LL << 52) || others > (1LL << 52) || own < -(1LL << 52)
            || others < -(1LL << 52))
            FALLBACK(PyMem_Free(loaded));
        /* Decayed.now */
        double recent = value;
        if (!(value == 0.0 || now <= at))
            recent = value * pow(0.5, (now - at) / half_life);
        if (remote != 0.0 && now > remote_at)
            remote *= pow(0.5, (now - remote_at) / half_life);
        recent += remote;
        total += recent;
        long long in_flight = own + others;
        double queued = pending + remote_pending;
        double flying = (double)in_flight;
        queued += request_tokens * (engine_requests > flying ? engine_requests : flying);
        row->in_flight = in_flight;
        row->queued = queued;
        row->recent = recent;
        row->full = kv_usage >= kv_usage_limit;
    }
    double shares_of = total + (double)(count * prompt_tokens);
    if (shares_of == 0.0)
        shares_of = (double)count;
    PyObject *rows = PyList_New(count);
    if (rows == NULL) {
        PyMem_Free(loaded);
        return NULL;
    }
    pos = 0;
    i = 0;
    while (PyDict_Next(names, &pos, &name, &ignored)) {
        Loaded *row = &loaded[i];
        double share = (row->recent + (double)prompt_tokens) / shares_of;
        PyObject *tuple = Py_BuildValue(
            "(OLdddO)", name, row->in_flight, row->queued, share, queue_weight * row->queued,
            row->full ? Py_True : Py_False);
        if (tuple == NULL) {
            Py_DECREF(rows);
            PyMem_Free(loaded);
            return NULL;
        }
        PyList_SET_ITEM(rows, i, tuple);
        i++;
    }
    PyMem_Free(loaded);
    /* the kin terms: per candidate its kin share less its share of all requests, None
       past the bound; None for all where no kin pulls */
    PyObject *terms = Py_None;
    Py_INCREF(terms);
    int has_kin = kinned == Py_None ? 0 : PyObject_IsTrue(kinned);
    if (has_kin < 0) {
        PyErr_Clear();
        Py_DECREF(rows);
        FALLBACK(Py_DECREF(terms));
    }
    if (has_kin && count) {
        if (!PyDict_CheckExact(kinned) || !PyDict_CheckExact(sent)) {
            Py_DECREF(rows);
            FALLBACK(Py_DECREF(terms));
        }
        double kin_total = 0.0, sent_total = 0.0;
        double *kins = PyMem_Malloc(sizeof(double) * 2 * count);
        if (kins == NULL) {
            Py_DECREF(rows);
            Py_DECREF(terms);
            return PyErr_NoMemory();
        }
        double *sents = kins + count;
        int bad = 0;
        for (i = 0; i < count && !bad; i++) {
            PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(rows, i), 0);
            PyObject *k = PyDict_GetItemWithError(kinned, key);
            PyObject *s = k == NULL && PyErr_Occurred() ? NULL : PyDict_GetItemWithError(sent, key);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                bad = 1;
                break;
            }
            kins[i] = 0.0;
            sents[i] = 0.0;
            int status = k == NULL ? 0 : kin_count(k, decayed_type, now, half_life, &kins[i]);
            if (!status && s != NULL)
                status = kin_count(s, decayed_type, now, half_life, &sents[i]);
            if (status < 0)
                PyErr_Clear();
            if (status)
                bad = 1;
            kin_total += kins[i];
            sent_total += sents[i];
        }
        if (bad) {
            PyMem_Free(kins);
            Py_DECREF(rows);
            FALLBACK(Py_DECREF(terms));
        }
        if (kin_total != 0.0) {
            Py_DECREF(terms);
            terms = PyList_New(count);
            if (terms == NULL) {
                PyMem_Free(kins);
                Py_DECREF(rows);
                return NULL;
            }
            for (i = 0; i < count; i++) {
                double kin_share = (kins[i] + 1.0) / (kin_total + (double)count);
                double sent_share = (sents[i] + 1.0) / (sent_total + (double)count);
                PyObject *term;
                if (sent_share * (double)count <= affinity_bound) {
                    term = PyFloat_FromDouble(kin_share - sent_share);
                    if (term == NULL) {
                        PyMem_Free(kins);
                        Py_DECREF(rows);
                        Py_DECREF(terms);
                        return NULL;
                    }
                }
                else {
                    term = Py_None;
                    Py_INCREF(term);
                }
                PyList_SET_ITEM(terms, i, term);
            }
        }
        PyMem_Free(kins);
    }
    PyObject *out = PyTuple_Pack(2, rows, terms);
    Py_DECREF(rows);
    Py_DECREF(terms);
    return out;
}

typedef struct {
    double cost;
    long long in_flight;
    PyObject *name; /* borrowed from the row */
    Py_ssize_t row;
    long long hit;
} Keyed;

/* The rule's order: cost, then requests in flight, then name (distinct str: a total
   order without NaN, so any sort gives Python's). */
static int
keyed_order(const void *left, const void *right)
{
    const Keyed *a = left, *b = right;
    if (a->cost != b->cost)
        return a->cost < b->cost ? -1 : 1;
    if (a->in_flight != b->in_flight)
        return a->in_flight < b->in_flight ? -1 : 1;
    int names = PyUnicode_Compare(a->name, b->name);
    if (names)
        return names;
    return a->row < b->row ? -1 : a->row > b->row;
}

static PyObject *
weigh_costed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "costed takes 10 arguments");
        return NULL;
    }
    PyObject *rows = args[0], *terms = args[1], *cached = args[3], *kv = args[4];
    PyObject *choice = args[9];
    long long prompt_tokens;
    double spread_weight, affinity_weight, checkpoint_weight;
    int leader = PyObject_IsTrue(args[8]);
    if (leader < 0)
        return NULL;
    if (!PyList_CheckExact(rows) || !PyDict_CheckExact(cached)
        || (terms != Py_None && !PyList_CheckExact(terms))
        || (kv != Py_None && !PyDict_CheckExact(kv)))
        Py_RETURN_NOTIMPLEMENTED;
    if (as_long(args[2], &prompt_tokens) || as_double(args[5], &spread_weight)
        || as_double(args[6], &affinity_weight) || as_double(args[7], &checkpoint_weight))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t count = PyList_GET_SIZE(rows);
    if (!count || prompt_tokens > (1LL << 40) || prompt_tokens < -(1LL << 40)
        || (terms != Py_None && PyList_GET_SIZE(terms) != count))
        Py_RETURN_NOTIMPLEMENTED;
    Keyed *keyed = PyMem_Malloc(sizeof(Keyed) * count);
    if (keyed == NULL)
        return PyErr_NoMemory();
    long long prompt = prompt_tokens < 0 ? 0 : prompt_tokens;
    long long best_hit = 0;
    Py_ssize_t i;
    for (i = 0; i < count; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 6)
            FALLBACK(PyMem_Free(keyed));
        PyObject *name = PyTuple_GET_ITEM(row, 0);
        if (!PyUnicode_CheckExact(name))
            FALLBACK(PyMem_Free(keyed));
        PyObject *found = PyDict_GetItemWithError(cached, name);
        long long hit = 0;
        if (found == NULL && PyErr_Occurred())
            FALLBACK(PyErr_Clear(); PyMem_Free(keyed));
        if (found != NULL && as_long(found, &hit))
            FALLBACK(PyMem_Free(keyed));
        hit = hit < 0 ? 0 : hit > prompt ? prompt : hit;
        if (hit > best_hit)
            best_hit = hit;
        keyed[i].hit = hit;
        keyed[i].name = name;
        keyed[i].row = i;
    }
    double fresh = (double)(prompt - best_hit);
    double spread = spread_weight * fresh;
    double pull = affinity_weight * fresh * (double)count;
    int with_kv = kv != Py_None && PyDict_GET_SIZE(kv) > 0;
    for (i = 0; i < count; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        long long in_flight;
        double queue_cost, share;
        if (as_long(PyTuple_GET_ITEM(row, 1), &in_flight)
            || as_double(PyTuple_GET_ITEM(row, 3), &share)
            || as_double(PyTuple_GET_ITEM(row, 4), &queue_cost))
            FALLBACK(PyMem_Free(keyed));
        long long hit = keyed[i].hit;
        double cost = (double)(prompt_tokens - hit) + queue_cost
                      + spread * ((double)count * share - 1.0);
        if (terms != Py_None) {
            PyObject *term = PyList_GET_ITEM(terms, i);
            if (term != Py_None) {
                double value;
                if (as_double(term, &value))
                    FALLBACK(PyMem_Free(keyed));
                cost -= pull * value;
            }
        }
        if (with_kv) {
            PyObject *found = PyDict_GetItemWithError(kv, keyed[i].name);
            long long held = 0;
            if (found == NULL && PyErr_Occurred())
                FALLBACK(PyErr_Clear(); PyMem_Free(keyed));
            if (found != NULL && as_long(found, &held))
                FALLBACK(PyMem_Free(keyed));
            long long beyond = (held < prompt_tokens ? held : prompt_tokens) - hit;
            cost -= checkpoint_weight * (double)(beyond > 0 ? beyond : 0);
        }
        if (PyTuple_GET_ITEM(row, 5) == Py_True)
            cost += (double)prompt_tokens;
        else if (PyTuple_GET_ITEM(row, 5) != Py_False)
            FALLBACK(PyMem_Free(keyed));
        if (isnan(cost))  /* no total order: Python's sort decides */
            FALLBACK(PyMem_Free(keyed));
        keyed[i].cost = cost;
        keyed[i].in_flight = in_flight;
    }
    if (leader) {
        Py_ssize_t best = 0;
        for (i = 1; i < count; i++)
            if (keyed_order(&keyed[i], &keyed[best]) < 0)
                best = i;
        PyObject *name = keyed[best].name;
        Py_INCREF(name);
        PyMem_Free(keyed);
        return name;
    }
    qsort(keyed, count, sizeof(Keyed), keyed_order);
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        PyMem_Free(keyed);
        return NULL;
    }
    for (i = 0; i < count; i++) {
        PyObject *row = PyList_GET_ITEM(rows, keyed[i].row);
        PyObject *cost = PyFloat_FromDouble(keyed[i].cost);
        PyObject *hit = PyLong_FromLongLong(keyed[i].hit);
        PyObject *made = NULL;
        if (cost != NULL && hit != NULL) {
            if (choice != Py_None) {  /* Choice(name, cost, hit, queued, share) */
                PyObject *parts[5] = {keyed[i].name, cost, hit, PyTuple_GET_ITEM(row, 2),
                                      PyTuple_GET_ITEM(row, 3)};
                made = PyObject_Vectorcall(choice, parts, 5, NULL);
            }
            else {  /* (cost, in_flight, name, hit, queued, share) */
                made = PyTuple_Pack(6, cost, PyTuple_GET_ITEM(row, 1), keyed[i].name, hit,
                                    PyTuple_GET_ITEM(row, 2), PyTuple_GET_ITEM(row, 3));
            }
        }
        Py_XDECREF(cost);
        Py_XDECREF(hit);
        if (made == NULL) {
            Py_DECREF(out);
            PyMem_Free(keyed);
            return NULL;
        }
        PyList_SET_ITEM(out, i, made);
    }
    PyMem_Free(keyed);
    return out;
}

/* Whether slot ``slot`` is set in ``bits`` (a non-negative exact int); -1 with an
   exception. */
static int
has_slot(PyObject *bits, long long slot)
{
    if (slot < 64)
        return (int)((PyLong_AsUnsignedLongLongMask(bits) >> slot) & 1ULL);
    PyObject *shift = PyLong_FromLongLong(slot);
    if (shift == NULL)
        return -1;
    PyObject *moved = PyNumber_Rshift(bits, shift);
    Py_DECREF(shift);
    if (moved == NULL)
        return -1;
    int set = (int)(PyLong_AsUnsignedLongLongMask(moved) & 1ULL);
    Py_DECREF(moved);
    return set;
}

/* How far ``hashes`` continues from ``start`` through the entries of ``table`` pending
   as of ``at`` (pcr.gateway.pending's rule: ``refs`` or ``until > at``); -1 with an
   exception, -2 for an input of another type. */
static Py_ssize_t
continued(PyObject *table, PyObject *hashes, Py_ssize_t start, double at)
{
    Py_ssize_t end = PyList_GET_SIZE(hashes), i = start;
    for (; i < end; i++) {
        PyObject *entry = PyDict_GetItemWithError(table, PyList_GET_ITEM(hashes, i));
        if (entry == NULL)
            return PyErr_Occurred() ? -1 : i;
        long long refs;
        int status = int_attr(entry, s_refs, &refs);
        if (status)
            return status < 0 ? -1 : -2;
        if (refs != 0)
            continue;
        double until;
        status = number_attr(entry, s_until, &until);
        if (status)
            return status < 0 ? -1 : -2;
        if (!(until > at))
            return i;
    }
    return i;
}

/* The farthest anchor of the other replicas' chains at one backend (``told``: its
   ``positions`` and ``anchors``) that ``hashes`` share, counting only chains whose held
   part ``listed`` covers (pcr.gateway.pending's ``_Far.prefix`` without checkpoints);
   0 for none, -1 with an exception, -2 for an input of another type. */
static Py_ssize_t
told_prefix(PyObject *told, PyObject *hashes, Py_ssize_t listed)
{
    PyObject *positions = PyObject_GetAttr(told, s_positions);
    if (positions == NULL)
        return -1;
    PyObject *anchors = PyObject_GetAttr(told, s_anchors);
    if (anchors == NULL) {
        Py_DECREF(positions);
        return -1;
    }
    Py_ssize_t found = 0, end = PyList_GET_SIZE(hashes);
    if (!PyList_CheckExact(positions) || !PyDict_CheckExact(anchors))
        found = -2;
    for (Py_ssize_t k = 0; !found && k < PyList_GET_SIZE(positions); k++) {
        long long position, at, offset;
        if (as_long(PyList_GET_ITEM(positions, k), &position) || position < 1) {
            found = -2;
            break;
        }
        if (position > end)
            continue;
        PyObject *anchor = PyDict_GetItemWithError(anchors, PyList_GET_ITEM(hashes, position - 1));
        if (anchor == NULL) {
            if (PyErr_Occurred())
                found = -1;
            continue;
        }
        if (!PyTuple_CheckExact(anchor) || PyTuple_GET_SIZE(anchor) != 3
            || as_long(PyTuple_GET_ITEM(anchor, 0), &at)
            || as_long(PyTuple_GET_ITEM(anchor, 1), &offset)) {
            found = -2;
            break;
        }
        if (at == position && offset <= listed)
            found = (Py_ssize_t)position;
    }
    Py_DECREF(positions);
    Py_DECREF(anchors);
    return found;
}

/* Name -> tokens for the blocks of ``blocks`` (whole blocks, never the last token). */
static PyObject *
tokens_of(PyObject *names, const Py_ssize_t *blocks, Py_ssize_t whole, long long size)
{
    Py_ssize_t count = PyList_GET_SIZE(names);
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = blocks[i];
        if (b <= 0)
            continue;
        PyObject *value = PyLong_FromLongLong((long long)(b < whole ? b : whole) * size);
        if (value == NULL || PyDict_SetItem(out, PyList_GET_ITEM(names, i), value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(value);
    }
    return out;
}

static PyObject *
weigh_decide(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 18) {
        PyErr_SetString(PyExc_TypeError, "decide takes 18 arguments");
        return NULL;
    }
    PyObject *backends = args[0], *steps = args[1], *slots = args[2], *pending = args[3];
    PyObject *far = args[4];
    PyObject *hashes = args[5], *rule = args[10], *kinned = args[11], *sent = args[12];
    PyObject *load_type = args[14], *decayed_type = args[15], *choice = args[16];
    PyObject *reach_type = args[17];
    double at, now;
    long long prompt_tokens, size;
    int tell = PyObject_IsTrue(args[13]);
    if (tell < 0)
        return NULL;
    if (!PyList_CheckExact(backends) || !PyList_CheckExact(steps) || !PyDict_CheckExact(slots)
        || !PyDict_CheckExact(pending) || !PyDict_CheckExact(far) || !PyList_CheckExact(hashes))
        Py_RETURN_NOTIMPLEMENTED;
    if (as_double(args[6], &at) || as_long(args[7], &prompt_tokens)
        || as_long(args[8], &size) || as_double(args[9], &now) || size <= 0
        || prompt_tokens > (1LL << 40) || prompt_tokens < -(1LL << 40))
        Py_RETURN_NOTIMPLEMENTED;
    /* the rule's weights, as Weighed reads them */
    PyObject *weights[8] = {s_half_life, s_request_tokens, s_kv_usage_limit, s_queue_weight,
                            s_affinity_bound, s_spread_weight, s_affinity_weight,
                            s_checkpoint_weight};
    PyObject *rule_values[8] = {NULL};
    for (int w = 0; w < 8; w++) {
        rule_values[w] = PyObject_GetAttr(rule, weights[w]);
        if (rule_values[w] == NULL) {
            for (int v = 0; v < w; v++)
                Py_DECREF(rule_values[v]);
            return NULL;
        }
    }
    PyObject *result = NULL, *names = NULL, *unique = NULL, *loads = NULL, *made = NULL;
    PyObject *cached = NULL, *alone = NULL, *order = NULL, *leader = NULL;
    Py_ssize_t *blocks = NULL;
    Py_ssize_t count = PyList_GET_SIZE(backends);
    int fallback = 0;
    names = PyList_New(count);
    unique = PyDict_New();
    loads = PyDict_New();
    blocks = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (count ? count : 1));
    if (names == NULL || unique == NULL || loads == NULL || blocks == NULL) {
        if (blocks == NULL)
            PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t *listed = blocks, *reached = blocks + count;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *backend = PyList_GET_ITEM(backends, i);
        PyObject *name = PyObject_GetAttr(backend, s_namespace);
        if (name == NULL)
            goto done;
        PyList_SET_ITEM(names, i, name);
        if (!PyUnicode_CheckExact(name)) {
            fallback = 1;
            goto done;
        }
        PyObject *load = PyObject_GetAttr(backend, s_load);
        if (load == NULL)
            goto done;
        int failed = PyDict_SetItem(loads, name, load) < 0 || PyDict_SetItem(unique, name, Py_None) < 0;
        Py_DECREF(load);
        if (failed)
            goto done;
        listed[i] = reached[i] = 0;
    }
    if (PyDict_GET_SIZE(unique) != count) {  /* a namespace twice: the general path */
        fallback = 1;
        goto done;
    }
    /* each one's prefix as the view lists it: the length of the step holding its slot */
    Py_ssize_t nsteps = PyList_GET_SIZE(steps);
    for (Py_ssize_t i = 0; i < count && nsteps; i++) {
        PyObject *slot = PyDict_GetItemWithError(slots, PyList_GET_ITEM(names, i));
        long long at_slot;
        if (slot == NULL) {
            if (PyErr_Occurred())
                goto done;
            continue;
        }
        if (as_long(slot, &at_slot) || at_slot < 0) {
            fallback = 1;
            goto done;
        }
        for (Py_ssize_t k = 0; k < nsteps; k++) {
            PyObject *step = PyList_GET_ITEM(steps, k);
            long long position;
            if (!PyTuple_CheckExact(step) || PyTuple_GET_SIZE(step) != 2
                || as_long(PyTuple_GET_ITEM(step, 0), &position)
                || !PyLong_CheckExact(PyTuple_GET_ITEM(step, 1)) || position < 0
                || position > PY_SSIZE_T_MAX) {
                fallback = 1;
                goto done;
            }
            int set = has_slot(PyTuple_GET_ITEM(step, 1), at_slot);
            if (set < 0)
                goto done;
            if (set) {
                listed[i] = reached[i] = (Py_ssize_t)position;
                break;
            }
        }
    }
    /* continued through the blocks pending there, this replica's and the others' */
    int changed = 0;
    if (PyDict_GET_SIZE(pending) || PyDict_GET_SIZE(far)) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *name = PyList_GET_ITEM(names, i);
            PyObject *mine = PyDict_GetItemWithError(pending, name);
            if (mine == NULL && PyErr_Occurred())
                goto done;
            PyObject *theirs = PyDict_GetItemWithError(far, name);
            if (theirs == NULL && PyErr_Occurred())
                goto done;
            if (mine == NULL && theirs == NULL)
                continue;
            PyObject *table = NULL;
            if (mine != NULL) {
                table = PyObject_GetAttr(mine, s_kv);
                if (table == NULL)
                    goto done;
                if (!PyDict_CheckExact(table)) {
                    Py_DECREF(table);
                    fallback = 1;
                    goto done;
                }
            }
            Py_ssize_t reach = listed[i];
            if (table != NULL)
                reach = continued(table, hashes, reach, at);
            if (reach >= 0 && theirs != NULL) {
                Py_ssize_t told = told_prefix(theirs, hashes, listed[i]);
                if (told < 0)
                    reach = told;
                else if (told > reach)
                    reach = table != NULL ? continued(table, hashes, told, at) : told;
            }
            Py_XDECREF(table);
            if (reach == -1)
                goto done;
            if (reach == -2) {
                fallback = 1;
                goto done;
            }
            reached[i] = reach;
            changed |= reach != listed[i];
        }
    }
    Py_ssize_t whole = prompt_tokens > 0 ? (Py_ssize_t)((prompt_tokens - 1) / size) : 0;
    cached = tokens_of(names, reached, whole, size);
    if (cached == NULL)
        goto done;
    PyObject *row_args[13] = {unique, args[7], loads, args[9], rule_values[0], rule_values[1],
                              rule_values[2], rule_values[3], kinned, sent, rule_values[4],
                              load_type, decayed_type};
    made = weigh_rows(self, row_args, 13);
    if (made == NULL)
        goto done;
    if (made == Py_NotImplemented) {
        fallback = 1;
        goto done;
    }
    PyObject *rows = PyTuple_GET_ITEM(made, 0), *terms = PyTuple_GET_ITEM(made, 1);
    PyObject *cost_args[10] = {rows, terms, args[7], cached, Py_None, rule_values[5],
                               rule_values[6], rule_values[7], Py_False, choice};
    order = weigh_costed(self, cost_args, 10);
    if (order == NULL)
        goto done;
    if (order == Py_NotImplemented) {
        fallback = 1;
        goto done;
    }
    int moved = 0;
    if (changed && tell && PyList_GET_SIZE(order)) {
        alone = tokens_of(names, listed, whole, size);
        if (alone == NULL)
            goto done;
        cost_args[3] = alone;
        cost_args[8] = Py_True;
        leader = weigh_costed(self, cost_args, 10);
        if (leader == NULL)
            goto done;
        if (leader == Py_NotImplemented) {
            fallback = 1;
            goto done;
        }
        PyObject *first = PyObject_GetAttr(PyList_GET_ITEM(order, 0), s_namespace);
        if (first == NULL)
            goto done;
        moved = PyUnicode_Compare(first, leader) != 0;
        Py_DECREF(first);
        if (moved && PyErr_Occurred())
            goto done;
    }
    /* the two best: what a request sent there leaves pending (Listed.reach) */
    Py_ssize_t top = PyList_GET_SIZE(order) < 2 ? PyList_GET_SIZE(order) : 2;
    for (Py_ssize_t t = 0; t < top; t++) {
        PyObject *chosen = PyList_GET_ITEM(order, t);
        PyObject *name = PyObject_GetAttr(chosen, s_namespace);
        if (name == NULL)
            goto done;
        Py_ssize_t i = 0;
        while (i < count && PyList_GET_ITEM(names, i) != name)
            i++;
        Py_DECREF(name);
        if (i == count) {
            fallback = 1;
            goto done;
        }
        PyObject *held = PyLong_FromSsize_t(listed[i]), *kv = PyLong_FromSsize_t(reached[i]);
        PyObject *reach = NULL;
        if (held != NULL && kv != NULL) {
            PyObject *parts[4] = {held, kv, kv, Py_False};
            reach = PyObject_Vectorcall(reach_type, parts, 4, NULL);
        }
        Py_XDECREF(held);
        Py_XDECREF(kv);
        if (reach == NULL)
            goto done;
        int failed = PyObject_SetAttr(chosen, s_reach, reach);
        Py_DECREF(reach);
        if (failed < 0)
            goto done;
    }
    int prefix = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        prefix |= reached[i] > 0 && whole > 0;
    result = Py_BuildValue("(OOO)", order, prefix ? Py_True : Py_False,
                           moved ? Py_True : Py_False);
done:
    for (int w = 0; w < 8; w++)
        Py_XDECREF(rule_values[w]);
    Py_XDECREF(names);
    Py_XDECREF(unique);
    Py_XDECREF(loads);
    Py_XDECREF(made);
    Py_XDECREF(cached);
    Py_XDECREF(alone);
    Py_XDECREF(order);
    Py_XDECREF(leader);
    PyMem_Free(blocks);
    if (fallback && result == NULL) {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"rows", (PyCFunction)(void (*)(void))weigh_rows, METH_FASTCALL,
     "Each candidate's load as the rule weighs it, and the kin terms."},
    {"costed", (PyCFunction)(void (*)(void))weigh_costed, METH_FASTCALL,
     "The rows costed for these prefixes, in the rule's order (or its leader)."},
    {"decide", (PyCFunction)(void (*)(void))weigh_decide, METH_FASTCALL,
     "The gateway's usual decision: prefixes from a walk and pending blocks, ranked."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_weigh", "The balance rule's arithmetic in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__weigh(void)
{
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_in_flight, "in_flight");
    INTERN(s_remote_in_flight, "remote_in_flight");
    INTERN(s_pending, "pending");
    INTERN(s_remote_pending, "remote_pending");
    INTERN(s_recent, "recent");
    INTERN(s_remote_recent, "remote_recent");
    INTERN(s_remote_at, "remote_at");
    INTERN(s_engine_requests, "engine_requests");
    INTERN(s_kv_usage, "kv_usage");
    INTERN(s_value, "value");
    INTERN(s_at, "at");
    INTERN(s_namespace, "namespace");
    INTERN(s_load, "load");
    INTERN(s_kv, "kv");
    INTERN(s_refs, "refs");
    INTERN(s_until, "until");
    INTERN(s_reach, "reach");
    INTERN(s_half_life, "half_life");
    INTERN(s_request_tokens, "request_tokens");
    INTERN(s_kv_usage_limit, "kv_usage_limit");
    INTERN(s_queue_weight, "queue_weight");
    INTERN(s_affinity_bound, "affinity_bound");
    INTERN(s_spread_weight, "spread_weight");
    INTERN(s_affinity_weight, "affinity_weight");
    INTERN(s_checkpoint_weight, "checkpoint_weight");
    INTERN(s_positions, "positions");
    INTERN(s_anchors, "anchors");
#undef INTERN
    return PyModule_Create(&module);
}
