// FP8 E4M3FN -> bfloat16 expansion inside a 1-token GEMV loop (vdpbf16ps), outside our kernels: how many
// weights per second each expansion allows per core and on all cores, with the rows in L1 (the compute
// ceiling) or streamed from memory. Variants: the byte table of ffi/fp8_bf16.h (two VBMI permutes, a
// ternary-logic OR of the sign, two unpacks); a sign-extend + shift + mask (two cross-lane word
// extensions); a shuffle-free split (each 16-bit lane's two bytes shifted into place, 3 shifts + 2
// ternary-logic ops per 64 weights); bf16 weights for reference. The shift forms are exact for FP8
// normals only (see bench/RESULTS.md). Needs AVX-512 BF16 + VBMI:
//
//     g++ -O2 -march=native bench/fp8_expand.cc -o /tmp/fp8_expand -lpthread && /tmp/fp8_expand
//
// Ends with one JSON line.
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <chrono>
#include <thread>
#include <string>
#include <vector>
#include <atomic>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
alignas(64) static uint8_t TH[128], TL[128];
struct Tabs{__m512i h0,h1,l0,l1;};
static inline __attribute__((always_inline)) void table(__m512i b,const Tabs&t,__m512i*f,__m512i*s){
  __m512i hi=_mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.h0,b,t.h1),b,_mm512_set1_epi8((char)0x80),0xf8);
  __m512i lo=_mm512_permutex2var_epi8(t.l0,b,t.l1);
  *f=_mm512_unpacklo_epi8(lo,hi); *s=_mm512_unpackhi_epi8(lo,hi);}
static inline __attribute__((always_inline)) void shift(const uint8_t*p,__m512i*f,__m512i*s){
  __m512i a=_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)),4);
  __m512i b=_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(p+32))),4);
  *f=_mm512_ternarylogic_epi32(a,_mm512_set1_epi16((short)0x87f0),_mm512_set1_epi16(0x3800),0xea);
  *s=_mm512_ternarylogic_epi32(b,_mm512_set1_epi16((short)0x87f0),_mm512_set1_epi16(0x3800),0xea);}
static inline __attribute__((always_inline)) void split(const uint8_t*p,__m512i*f,__m512i*s){
  __m512i w=_mm512_loadu_si512(p);
  const __m512i a=_mm512_set1_epi16((short)0x87f0), o=_mm512_set1_epi16(0x3800);
  *s=_mm512_ternarylogic_epi32(_mm512_srai_epi16(w,4),a,o,0xea);
  *f=_mm512_ternarylogic_epi32(_mm512_srai_epi16(_mm512_slli_epi16(w,8),4),a,o,0xea);}
// V: 0 table, 1 sign-extend + shift, 3 bf16 weights (2 bytes each), 4 shuffle-free split
template<int V,int R> __attribute__((noinline)) float gemv(const uint8_t*w,long rows,long cols,const uint16_t*x,long pf){
  Tabs t{_mm512_load_si512(TH),_mm512_load_si512(TH+64),_mm512_load_si512(TL),_mm512_load_si512(TL+64)};
  __m512 tot=_mm512_setzero_ps(); long bpr = V==3? cols*2: cols;
  for(long r0=0;r0<rows;r0+=R){
    const uint8_t* rp[R]; for(int r=0;r<R;r++) rp[r]=w+(r0+r)*bpr;
    __m512 acc[R]; for(int r=0;r<R;r++) acc[r]=_mm512_setzero_ps();
    for(long c=0;c<cols;c+=64){
      if(pf) for(int r=0;r<R;r++){ _mm_prefetch((const char*)rp[r]+c*(V==3?2:1)+pf,_MM_HINT_T0); if(V==3) _mm_prefetch((const char*)rp[r]+c*2+pf+64,_MM_HINT_T0);}
      __m512i xf=_mm512_loadu_si512(x+c), xs=_mm512_loadu_si512(x+c+32);
      for(int r=0;r<R;r++){ __m512i f,s;
        if(V==0) table(_mm512_loadu_si512(rp[r]+c),t,&f,&s);
        else if(V==4) split(rp[r]+c,&f,&s);
        else if(V==1) shift(rp[r]+c,&f,&s);
        else { f=_mm512_loadu_si512(rp[r]+2*c); s=_mm512_loadu_si512(rp[r]+2*c+64);} 
        acc[r]=_mm512_dpbf16_ps(acc[r],(__m512bh)f,(__m512bh)xf); acc[r]=_mm512_dpbf16_ps(acc[r],(__m512bh)s,(__m512bh)xs);}
    }
    for(int r=0;r<R;r++) tot=_mm512_add_ps(tot,acc[r]);
  }
  return _mm512_reduce_add_ps(tot);}
typedef float(*Fn)(const uint8_t*,long,long,const uint16_t*,long);
struct Var{const char*name;Fn fn;int bytes;};
int main(int argc,char**argv){
  for(int i=0;i<128;i++){ float v; int e=(i>>3)&15,m=i&7; v= e? ldexpf(1+m/8.f,e-7): ldexpf(m/8.f,-6); uint32_t u; memcpy(&u,&v,4); uint16_t b=u>>16; if(i==127) b=0x7fc0; TH[i]=b>>8; TL[i]=b&255; }
  Var vars[]={{"table R4",gemv<0,4>,1},{"shift R4",gemv<1,4>,1},{"split R4",gemv<4,4>,1},{"split R8",gemv<4,8>,1},{"split R2",gemv<4,2>,1},{"bf16 R4",gemv<3,4>,2}};
  int nt=std::thread::hardware_concurrency(); long cols=7168;
  std::vector<uint16_t> x(cols+64,0x3f80);
  std::string json="{\"bench\": \"fp8_expand\", \"cols\": 7168, \"results\": [";
  for(auto&v:vars){
    // L1-resident: 8 rows, repeated; then streaming: each thread its own 256 MB (bytes-per-weight adjusted)
    for(int threads: {1, nt}){
      for(int mode=0;mode<2;mode++){
        long rows = mode==0? 8 : (256L<<20)/(cols*v.bytes)/8*8;
        long reps = mode==0? 20000 : 4;
        std::vector<uint8_t*> bufs(threads);
        for(int t=0;t<threads;t++){ bufs[t]=(uint8_t*)aligned_alloc(64,rows*cols*v.bytes+4096); for(long i=0;i<rows*cols*v.bytes;i++) bufs[t][i]=(uint8_t)((i*37)%255)|8; }
        std::atomic<int> go{0}; std::vector<std::thread> th; std::vector<double> secs(threads);
        for(int t=0;t<threads;t++) th.emplace_back([&,t]{ while(!go.load()); double s=now(); float z=0; for(long k=0;k<reps;k++) z+=v.fn(bufs[t],rows,cols,x.data(),mode?512*v.bytes:0); secs[t]=now()-s; if(z==1234.5f) printf("!");});
        go=1; for(auto&h:th) h.join(); double mx=0; for(double s:secs) mx=s>mx?s:mx;
        double gb=(double)threads*reps*rows*cols*v.bytes/mx/1e9;
        printf("%-14s %s threads %2d: %7.1f GB/s  (%.2f Gweights/s per core)\n",v.name,mode?"DRAM":"L1  ",threads,gb,gb/v.bytes/threads);
        char item[200]; snprintf(item,sizeof item,"%s{\"variant\": \"%s\", \"data\": \"%s\", \"threads\": %d, \"gbps\": %.1f}",json.back()=='['?"":", ",v.name,mode?"dram":"l1",threads,gb); json+=item;
        for(auto b:bufs) free(b);
      }
    }
  }
  printf("%s]}\n",json.c_str());
}
