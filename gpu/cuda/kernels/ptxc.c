/* ptxc: compiles CUDA C to PTX with NVRTC (no GPU and no nvcc needed).
 * Usage: ptxc ARCH IN.cu OUT.ptx   (ARCH e.g. compute_80)
 * Used by `make cuda-ptx` when nvcc is not installed (gpu/README.md). */
#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(n + 1);
    if (fread(b, 1, n, f) != (size_t)n) { perror(path); exit(1); }
    b[n] = 0;
    fclose(f);
    return b;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: ptxc ARCH INCLUDE_DIR IN.cu OUT.ptx\n"); return 2; }
    char arch[64], inc[4096];
    snprintf(arch, sizeof arch, "--gpu-architecture=%s", argv[1]);
    snprintf(inc, sizeof inc, "--include-path=%s", argv[2]);
    const char *opts[] = {arch, inc, "--std=c++17", "-default-device"};
    char *src = slurp(argv[3]);
    nvrtcProgram prog;
    if (nvrtcCreateProgram(&prog, src, argv[3], 0, NULL, NULL) != NVRTC_SUCCESS) return 1;
    nvrtcResult rc = nvrtcCompileProgram(prog, (int)(sizeof opts / sizeof opts[0]), opts);
    size_t logn;
    nvrtcGetProgramLogSize(prog, &logn);
    if (logn > 1) {
        char *log = malloc(logn);
        nvrtcGetProgramLog(prog, log);
        fprintf(stderr, "%s\n", log);
    }
    if (rc != NVRTC_SUCCESS) { fprintf(stderr, "ptxc: %s\n", nvrtcGetErrorString(rc)); return 1; }
    size_t n;
    nvrtcGetPTXSize(prog, &n);
    char *ptx = malloc(n);
    nvrtcGetPTX(prog, ptx);
    FILE *o = fopen(argv[4], "wb");
    if (!o || fwrite(ptx, 1, n - 1, o) != n - 1) { perror(argv[4]); return 1; }
    fclose(o);
    return 0;
}
