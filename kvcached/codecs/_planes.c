/* Byte planes of fixed-width elements: split and merge (kvcached/codecs/planes.py).
 *
 * split(src, width) -> bytes: plane i (byte i of every element) after plane i-1.
 * merge(planes, width, out): the inverse, written into the writable buffer ``out``; ``planes``
 * is a sequence of ``width`` buffers of len(out) / width bytes each.
 *
 * numpy's strided copies do the same at a few hundred MB/s; these loops run at memory speed. The
 * module is optional: planes.py falls back to numpy (the reference the tests compare with). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_WIDTH 8

static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer src;
    int width;
    if (!PyArg_ParseTuple(args, "y*i", &src, &width))
        return NULL;
    if (width < 1 || width > MAX_WIDTH || src.len % width) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "width must be 1..8 and divide the buffer's length");
        return NULL;
    }
    Py_ssize_t n = src.len / width;
    PyObject *out = PyBytes_FromStringAndSize(NULL, src.len);
    if (out == NULL) {
        PyBuffer_Release(&src);
        return NULL;
    }
    const unsigned char *in = (const unsigned char *)src.buf;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) {
        unsigned char *lo = dst, *hi = dst + n;
        for (Py_ssize_t i = 0; i < n; i++) {
            lo[i] = in[2 * i];
            hi[i] = in[2 * i + 1];
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            for (int b = 0; b < width; b++)
                dst[b * n + i] = in[i * width + b];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return out;
}

static PyObject *merge(PyObject *self, PyObject *args) {
    PyObject *planes;
    int width;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Oiw*", &planes, &width, &out))
        return NULL;
    Py_buffer views[MAX_WIDTH];
    int held = 0;
    PyObject *result = NULL;
    if (width < 1 || width > MAX_WIDTH || out.len % width || PySequence_Size(planes) != width) {
        PyErr_SetString(PyExc_ValueError, "width must be 1..8, divide the output's length, and count the planes");
        goto done;
    }
    Py_ssize_t n = out.len / width;
    for (; held < width; held++) {
        PyObject *plane = PySequence_GetItem(planes, held);
        if (plane == NULL)
            goto done;
        int failed = PyObject_GetBuffer(plane, &views[held], PyBUF_SIMPLE);
        Py_DECREF(plane);
        if (failed)
            goto done;
        if (views[held].len != n) {
            held++;
            PyErr_SetString(PyExc_ValueError, "a plane's length is not the output's / width");
            goto done;
        }
    }
    unsigned char *dst = (unsigned char *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) {
        const unsigned char *lo = (const unsigned char *)views[0].buf, *hi = (const unsigned char *)views[1].buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            dst[2 * i] = lo[i];
            dst[2 * i + 1] = hi[i];
        }
    } else {
        for (int b = 0; b < width; b++) {
            const unsigned char *p = (const unsigned char *)views[b].buf;
            for (Py_ssize_t i = 0; i < n; i++)
                dst[i * width + b] = p[i];
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(src, width) -> bytes: the byte planes of src, plane 0 first."},
    {"merge", merge, METH_VARARGS, "merge(planes, width, out): interleave the planes into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", "Byte planes: split and merge.", -1, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
