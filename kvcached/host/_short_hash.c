/* BLAKE3 of short inputs (one chunk: at most 1024 bytes), many at a time.
 *
 * The daemon hashes a 36-byte index key (digest | u32 layer, kvcached_agent.address) for every
 * block of every Allocate and Load an agent sends, and a 32-byte tenant address per block where
 * tenants are on (kvcached.tenants caches those). Through the blake3 package each such hash costs ~1.1-1.4 us, nearly all of it
 * the call's Python overhead (the compression itself is ~0.1 us): this module hashes a whole
 * request's inputs in one call. kvcached/host/short_hash.py holds the Python reference (the
 * blake3 package) and the fallback; tests/unit/test_short_hash.py checks one against the other
 * on random inputs. Written from the BLAKE3 specification (one chunk, so no tree: the chunk's
 * last block is the root).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_LEN 64
#define CHUNK_LEN 1024
#define OUT_LEN 32

enum {
    CHUNK_START = 1 << 0,
    CHUNK_END = 1 << 1,
    ROOT = 1 << 3,
    KEYED_HASH = 1 << 4,
    DERIVE_KEY_CONTEXT = 1 << 5,
    DERIVE_KEY_MATERIAL = 1 << 6,
};

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

static const uint8_t PERMUTATION[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};

static inline uint32_t rotr(uint32_t w, unsigned c) { return (w >> c) | (w << (32 - c)); }

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void store32(uint8_t *p, uint32_t w) {
    p[0] = (uint8_t)w;
    p[1] = (uint8_t)(w >> 8);
    p[2] = (uint8_t)(w >> 16);
    p[3] = (uint8_t)(w >> 24);
}

static inline void g(uint32_t *s, int a, int b, int c, int d, uint32_t x, uint32_t y) {
    s[a] = s[a] + s[b] + x;
    s[d] = rotr(s[d] ^ s[a], 16);
    s[c] = s[c] + s[d];
    s[b] = rotr(s[b] ^ s[c], 12);
    s[a] = s[a] + s[b] + y;
    s[d] = rotr(s[d] ^ s[a], 8);
    s[c] = s[c] + s[d];
    s[b] = rotr(s[b] ^ s[c], 7);
}

/* The compression function: ``cv`` becomes the first 8 words of the output (chunk counter 0). */
static void compress(uint32_t cv[8], const uint8_t block[BLOCK_LEN], uint32_t block_len, uint32_t flags) {
    uint32_t m[16], t[16], s[16];
    for (int i = 0; i < 16; i++)
        m[i] = load32(block + 4 * i);
    for (int i = 0; i < 8; i++)
        s[i] = cv[i];
    s[8] = IV[0], s[9] = IV[1], s[10] = IV[2], s[11] = IV[3];
    s[12] = 0, s[13] = 0, s[14] = block_len, s[15] = flags;
    for (int round = 0; round < 7; round++) {
        g(s, 0, 4, 8, 12, m[0], m[1]);
        g(s, 1, 5, 9, 13, m[2], m[3]);
        g(s, 2, 6, 10, 14, m[4], m[5]);
        g(s, 3, 7, 11, 15, m[6], m[7]);
        g(s, 0, 5, 10, 15, m[8], m[9]);
        g(s, 1, 6, 11, 12, m[10], m[11]);
        g(s, 2, 7, 8, 13, m[12], m[13]);
        g(s, 3, 4, 9, 14, m[14], m[15]);
        if (round < 6) {
            for (int i = 0; i < 16; i++)
                t[i] = m[PERMUTATION[i]];
            memcpy(m, t, sizeof m);
        }
    }
    for (int i = 0; i < 8; i++)
        cv[i] = s[i] ^ s[i + 8];
}

/* BLAKE3 of ``len`` (<= CHUNK_LEN) bytes with the key words ``key`` and mode ``flags``. */
static void hash_chunk(const uint32_t key[8], uint32_t flags, const uint8_t *data, size_t len, uint8_t out[OUT_LEN]) {
    uint32_t cv[8];
    uint8_t block[BLOCK_LEN];
    memcpy(cv, key, sizeof cv);
    size_t blocks = len ? (len + BLOCK_LEN - 1) / BLOCK_LEN : 1;
    for (size_t i = 0; i < blocks; i++) {
        size_t take = len - i * BLOCK_LEN < BLOCK_LEN ? len - i * BLOCK_LEN : BLOCK_LEN;
        memset(block, 0, sizeof block);
        memcpy(block, data + i * BLOCK_LEN, take);
        uint32_t f = flags | (i == 0 ? CHUNK_START : 0) | (i + 1 == blocks ? CHUNK_END | ROOT : 0);
        compress(cv, block, (uint32_t)take, f);
    }
    for (int i = 0; i < 8; i++)
        store32(out + 4 * i, cv[i]);
}

/* The key words of a 32-byte bytes-like ``obj``; -1 with an exception set otherwise. */
static int key_words(PyObject *obj, uint32_t key[8]) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view.len != 32) {
        PyErr_Format(PyExc_ValueError, "a key is 32 bytes, got %zd", view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    for (int i = 0; i < 8; i++)
        key[i] = load32((const uint8_t *)view.buf + 4 * i);
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *out_bytes(const uint8_t out[OUT_LEN]) { return PyBytes_FromStringAndSize((const char *)out, OUT_LEN); }

PyDoc_STRVAR(hash_doc, "hash(data, key=None, context=None) -> bytes\n\n"
                       "BLAKE3-256 of ``data`` (at most 1024 bytes): plain, keyed with a 32-byte ``key``, or in\n"
                       "derive-key mode with ``context`` (bytes). What blake3.blake3 gives for the same.");

static PyObject *short_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"data", "key", "context", NULL};
    Py_buffer data, context = {0};
    PyObject *key_obj = Py_None;
    int has_context = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|Oz*", names, &data, &key_obj, &context))
        return NULL;
    has_context = context.obj != NULL;
    PyObject *result = NULL;
    uint32_t key[8];
    uint32_t flags = 0;
    uint8_t out[OUT_LEN];
    if (data.len > CHUNK_LEN || (has_context && context.len > CHUNK_LEN)) {
        PyErr_SetString(PyExc_ValueError, "short inputs only: at most 1024 bytes");
        goto done;
    }
    if (key_obj != Py_None && has_context) {
        PyErr_SetString(PyExc_ValueError, "a key or a context, not both");
        goto done;
    }
    if (has_context) {
        uint8_t derived[OUT_LEN];
        hash_chunk(IV, DERIVE_KEY_CONTEXT, context.buf, (size_t)context.len, derived);
        for (int i = 0; i < 8; i++)
            key[i] = load32(derived + 4 * i);
        flags = DERIVE_KEY_MATERIAL;
    } else if (key_obj != Py_None) {
        if (key_words(key_obj, key) < 0)
            goto done;
        flags = KEYED_HASH;
    } else {
        memcpy(key, IV, sizeof key);
    }
    hash_chunk(key, flags, data.buf, (size_t)data.len, out);
    result = out_bytes(out);
done:
    PyBuffer_Release(&data);
    if (context.obj != NULL)
        PyBuffer_Release(&context);
    return result;
}

PyDoc_STRVAR(index_keys_doc, "index_keys(context, digests, layer) -> list[bytes]\n\n"
                             "The index key of each of ``digests`` (32-byte bytes each) at ``layer`` (0..2**32-1, or a\n"
                             "sequence of as many layers): BLAKE3 in derive-key mode with ``context`` (bytes) of\n"
                             "digest | u32 layer (little-endian). ValueError names the first entry that is not an address.");

static PyObject *index_keys(PyObject *self, PyObject *args) {
    Py_buffer context;
    PyObject *digests_obj, *layer_obj;
    if (!PyArg_ParseTuple(args, "y*OO", &context, &digests_obj, &layer_obj))
        return NULL;
    if (context.len > CHUNK_LEN) {
        PyBuffer_Release(&context);
        PyErr_SetString(PyExc_ValueError, "short inputs only: a context of at most 1024 bytes");
        return NULL;
    }
    uint32_t key[8];
    uint8_t derived[OUT_LEN];
    hash_chunk(IV, DERIVE_KEY_CONTEXT, context.buf, (size_t)context.len, derived);
    PyBuffer_Release(&context);
    for (int i = 0; i < 8; i++)
        key[i] = load32(derived + 4 * i);
    PyObject *digests = PySequence_Fast(digests_obj, "digests must be a sequence");
    if (digests == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(digests);
    PyObject *layers = NULL;
    unsigned long long one_layer = 0;
    if (PyLong_Check(layer_obj)) {
        one_layer = PyBool_Check(layer_obj) ? (unsigned long long)-1 : PyLong_AsUnsignedLongLong(layer_obj);
        if ((one_layer == (unsigned long long)-1 && PyErr_Occurred()) || one_layer > 0xFFFFFFFFull) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "layer must be in 0..%u", 0xFFFFFFFFu);
            Py_DECREF(digests);
            return NULL;
        }
    } else {
        layers = PySequence_Fast(layer_obj, "layer must be an int or a sequence of ints");
        if (layers == NULL || PySequence_Fast_GET_SIZE(layers) != n) {
            if (layers != NULL)
                PyErr_SetString(PyExc_ValueError, "as many layers as digests");
            Py_XDECREF(layers);
            Py_DECREF(digests);
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    uint8_t material[36], hashed[OUT_LEN];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(digests, i);
        if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) != 32) {
            PyErr_Format(PyExc_ValueError, "entry %zd: a digest is 32 bytes", i);
            goto fail;
        }
        unsigned long long layer = one_layer;
        if (layers != NULL) {
            PyObject *l = PySequence_Fast_GET_ITEM(layers, i);
            if (!PyLong_Check(l) || PyBool_Check(l)) {
                PyErr_Format(PyExc_ValueError, "entry %zd: a layer is an integer", i);
                goto fail;
            }
            layer = PyLong_AsUnsignedLongLong(l);
            if ((layer == (unsigned long long)-1 && PyErr_Occurred()) || layer > 0xFFFFFFFFull) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "entry %zd: layer must be in 0..%u", i, 0xFFFFFFFFu);
                goto fail;
            }
        }
        memcpy(material, PyBytes_AS_STRING(d), 32);
        store32(material + 32, (uint32_t)layer);
        hash_chunk(key, DERIVE_KEY_MATERIAL, material, sizeof material, hashed);
        PyObject *b = out_bytes(hashed);
        if (b == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, b);
    }
    Py_XDECREF(layers);
    Py_DECREF(digests);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(layers);
    Py_DECREF(digests);
    return NULL;
}

static PyMethodDef methods[] = {
    {"hash", (PyCFunction)(void (*)(void))short_hash, METH_VARARGS | METH_KEYWORDS, hash_doc},
    {"index_keys", index_keys, METH_VARARGS, index_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcached.host._short_hash",
    "BLAKE3 of short inputs, many a call (see kvcached/host/short_hash.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__short_hash(void) { return PyModule_Create(&module); }
