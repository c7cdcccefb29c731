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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static PyObject *s_in_flight, *s_remote_in_flight, *s_pending, *s_remote_pending,
    *s_recent, *s_remote_recent, *s_remote_at, *s_engine_requests, *s_kv_usage, *s_value,
    *s_at;

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

static PyMethodDef methods[] = {
    {"rows", (PyCFunction)(void (*)(void))weigh_rows, METH_FASTCALL,
     "Each candidate's load as the rule weighs it, and the kin terms."},
    {"costed", (PyCFunction)(void (*)(void))weigh_costed, METH_FASTCALL,
     "The rows costed for these prefixes, in the rule's order (or its leader)."},
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
#undef INTERN
    return PyModule_Create(&module);
}
