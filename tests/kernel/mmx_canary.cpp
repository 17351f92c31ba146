// A program whose code names an MMX register: the no_mmx check must report it (tests/CMakeLists.txt).
int main() {
  __asm__ volatile("pxor %%mm0, %%mm0\n\temms" : : : "mm0");
  return 0;
}
